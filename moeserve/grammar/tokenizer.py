"""The model's tokenizer as llguidance sees it: built from the same ``tokenizer.json``
(its Rust ``tokenizers`` form), with every id of the model's vocabulary (the logits may be
wider than the tokenizer: ids past it are never allowed) and the generation's EOS ids."""

from __future__ import annotations

from functools import lru_cache

import llguidance as llg

from moeserve.tokenizer import Tokenizer


@lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> llg.LLTokenizer:
    """The llguidance tokenizer of ``tokenizer`` over ``vocab_size`` ids (built once per
    tokenizer and size: it reads every token's bytes)."""
    return llg.LLTokenizer(
        tokenizer.backend_json(),
        n_vocab=max(vocab_size, tokenizer.vocab_size),
        eos_token=sorted(tokenizer.eos_token_ids),
    )
