"""Over HTTP, a prompt sent again (its prefix now cached) gets the tokens and logprobs it got
cold (issue 20, part 3; tests/unit/test_prefix_cache_parity.py has the engine-side checks).

Prompts of k blocks + 1 token: the hit leaves one token to compute, which must run the prefill
path as it did cold. One request at a time, so both sends batch alike. The shared server runs
the demo model with ``dtype="auto"``: bf16 weights on a CPU with AMX, where the decode path
moved these logprobs by ~1e-2.
"""

from __future__ import annotations

import random

BS = 16  # the server's block size


def test_a_repeated_prompt_gets_what_it_got_cold(client, model):
    rng = random.Random(2020)  # prompts no other test sends: the first send is cold
    prompts = [[rng.randrange(4, 512) for _ in range(k * BS + 1)] for k in (1, 2, 3, 4, 6)]

    def send(prompt):
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=1
        )
        lp = r.choices[0].logprobs
        return lp.tokens, lp.token_logprobs, r.usage.prompt_tokens_details.cached_tokens

    first = [send(p) for p in prompts]
    again = [send(p) for p in prompts]
    assert [c for _, _, c in first] == [0] * len(prompts)
    assert [c for _, _, c in again] == [len(p) - 1 for p in prompts]
    for (t1, l1, _), (t2, l2, _) in zip(first, again, strict=True):
        assert t2 == t1
        assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) <= 1e-5
