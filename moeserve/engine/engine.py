"""The engine: requests in, :class:`RequestOutput` out, one scheduler step at a time.

step():  batch = scheduler.schedule()
         results = model_runner.run(batch)            # forward + sampling
         updated = scheduler.update(batch, tokens)    # append, token-level stops, free
         return outputs.process(updated)              # detokenize, stop strings, group by request
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from moeserve.config import EngineConfig
from moeserve.core import (
    FinishReason,
    KVRole,
    PromptType,
    RequestOutput,
    SampleProgress,
    SamplingParams,
    Sequence,
)
from moeserve.disagg.connector import LocalConnector
from moeserve.disagg.rank import KVRank
from moeserve.distributed.groups import ParallelGroups
from moeserve.engine.codec import SeqStepOutput
from moeserve.engine.disagg_mode import DisaggMode, kv_heads
from moeserve.engine.engine_setup import (
    GIB,
    allocate_kv_pool,
    load_tokenizer,
    resident_bytes,
    resolve_max_model_len,
    scheduler_config,
)
from moeserve.engine.output_processor import OutputProcessor
from moeserve.engine.scheduler import Scheduler
from moeserve.engine.spec_setup import make_runner
from moeserve.eplb.balancer import ExpertBalancer, run_command
from moeserve.grammar.bank import GrammarBank
from moeserve.models.hf_config import ModelConfig
from moeserve.models.loader import checkpoint_quantization, load_model
from moeserve.ops import formats
from moeserve.ops.cpu.allocator import keep_freed_memory, release_freed_memory
from moeserve.ops.cpu.hugepages import move_to_huge_pages
from moeserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """One DP replica's engine. On one process it is the whole engine (an
    :class:`~moeserve.engine.interface.Engine`); in an engine group
    (``moeserve/launch/engine_group.py``) every rank runs one, in step with the others."""

    # the data members of the Engine protocol (set in __init__)
    config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    max_model_len: int

    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        """Load the model (this rank's share of it), then size the KV cache and build the
        scheduler, the runner, the expert balancer and the output processor. Raises
        ValueError for a ``max_model_len`` the model or the KV cache cannot hold."""
        self.config = config
        self.groups = groups = groups or ParallelGroups.single()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = config.torch_device
        # the weight format applied at load (None: the model dtype) and the dtype computed in
        # an AWQ / GPTQ checkpoint is served in int4 weights (w4a8_int8 if asked, else int4)
        quantization = checkpoint_quantization(
            config.model, config.quantization, config.int4_group_size
        )
        self.weight_format, self.dtype = formats.resolve(quantization, config.dtype, self.device)
        t0 = time.perf_counter()
        self._load_model()
        # an idle replica must still join the expert all-to-alls of a step
        dims = groups.dims
        self.run_empty_when_idle = dims.enable_expert_parallel and dims.dp > 1
        self.max_model_len = resolve_max_model_len(config, self.model_config)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids
            if self.tokenizer
            else frozenset(self.model_config.eos_token_ids)
        )
        self.kv_pool = allocate_kv_pool(
            config, self.model, self.model_config, self.max_model_len, self.device
        )
        self.scheduler = Scheduler(
            scheduler_config(config, self.max_model_len, self.kv_pool.num_blocks)
        )
        self.runner = make_runner(
            self.model,
            self.kv_pool.caches,
            config.block_size,
            self.device,
            groups,
            config.speculative_num_tokens,
            config.speculative_token_map,
        )
        # structured output: the matchers of the requests held to a grammar (the rank that
        # samples uses them: every rank keeps one, it costs nothing until a request asks)
        self.grammars = GrammarBank(self.tokenizer)
        self.runner.grammars = self.grammars
        # expert-load statistics and placement (EPLB); None without MoE layers on this rank
        self.eplb = ExpertBalancer.create(
            self.model.moe_blocks(), self.model.config, groups, config.eplb_options
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler)
        # prefill/decode disaggregation: the role requests take and the transfer parts
        # (engine/disagg_mode.py); a group's rank 0 runs its control (launch/group_disagg.py)
        heads = kv_heads(self.model, self.model_config.num_key_value_heads)
        self.disagg = DisaggMode(config, self.scheduler, self.kv_pool, groups, heads)
        self._finished_outside: list[Sequence] = []  # ended between steps, reported by the next
        self._log_ready(time.perf_counter() - t0)

    @property
    def disaggregation_mode(self) -> str:
        """The role new requests take: "null" (colocated), "prefill" or "decode"."""
        return self.disagg.mode

    @property
    def kv_connector(self) -> LocalConnector | None:
        """One process's KV-transfer control and rank (None colocated or on a group's rank)."""
        return self.disagg.connector

    @property
    def kv_rank(self) -> KVRank | None:
        """This rank's end of the KV transfers (None when colocated)."""
        return self.disagg.rank

    def _load_model(self) -> None:
        """Load the weights (sets ``model``, ``model_config``, ``load_report``), move them to
        huge pages on a CPU and record what loading kept resident (``load_rss_bytes``)."""
        config, groups = self.config, self.groups
        rss0 = resident_bytes()
        self.model, self.model_config, self.load_report = load_model(
            config.model,
            self.dtype,
            self.device,
            max_positions=None,
            # a parallel layout loads the (unsharded) MTP layer only to draft with it
            load_mtp=config.load_mtp
            and (groups.dims.world_size == 1 or config.speculative_num_tokens > 0),
            progress=config.progress and groups.rank == 0,
            groups=groups,
            moe_options=config.moe_options,
            weight_format=formats.configured(
                self.weight_format, config.int4_group_size, config.int4_symmetric
            ),
        )
        # weights stream through 2 MB pages on a CPU (ops/cpu/hugepages.py)
        self.huge_page_bytes = move_to_huge_pages(self.model) if self.device.type == "cpu" else 0
        if self.device.type == "cpu":
            # loading's temporaries go back to the OS (also when an earlier engine of this
            # process already turned trimming off)
            release_freed_memory()
        self.load_rss_bytes = resident_bytes() - rss0  # what loading kept resident
        if self.device.type == "cpu":
            # from here on, step temporaries reuse freed pages instead of faulting in fresh ones
            keep_freed_memory()

    def _log_ready(self, seconds: float) -> None:
        # the weights' format beside the compute dtype: dtype "auto" on an AMX CPU computes
        # in fp32 over bf16 weights, which round unlike fp32 weights
        logger.info(
            "engine ready in %.1fs: %s, %s weights, %s activations on %s, %d KV blocks "
            "(%.2f GiB), max_model_len %d",
            seconds,
            self.model_config.architecture,
            self.weight_format or str(self.dtype).removeprefix("torch."),
            self.dtype,
            self.device,
            self.kv_pool.num_blocks,
            self.kv_pool.num_bytes / GIB,
            self.max_model_len,
        )

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> None:
        """Queue a request (text or token ids). Raises ValueError for a prompt we cannot run."""
        params = params or SamplingParams()
        prompt_text, prompt_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_ids, params)
        self.add_tokenized(request_id, prompt_ids, params, prompt_text)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt given as text or as token ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass token ids, not text")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def add_tokenized(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None = None,
        progress: list[SampleProgress] | None = None,
    ) -> None:
        """Queue a prompt already checked by :meth:`validate_prompt`.

        With bootstrap fields (``params.kv_transfer``) on a prefill instance, the request
        computes its prompt's KV for a decode instance and ends with no token; on a decode
        instance it takes that KV and decodes (``moeserve/disagg/``).

        ``progress`` (one per sample): the request resumes where a lost replica left it
        (elastic EP, ``launch/elastic.py``): each sample continues after the tokens its
        caller has received (their KV is computed again), and the waiting queue's bound does
        not apply (the request was admitted before)."""
        if progress is not None:
            self._add_resumed(request_id, prompt_ids, params, prompt_text, progress)
            return
        role = self.disagg.role_of(prompt_ids, params)
        seqs = [
            Sequence(
                request_id=request_id,
                # the decode side runs the last prompt token itself (it samples from it)
                prompt_token_ids=prompt_ids[:-1] if role is KVRole.PREFILL else prompt_ids,
                params=params,
                sample_index=i,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
                kv_role=role,
            )
            for i in range(1 if role is KVRole.PREFILL else params.n)
        ]
        # first, as it raises for a request id in use: nothing else holds the request yet
        self.outputs.add(request_id, prompt_text, prompt_ids, params, seqs)
        if role is KVRole.LOCAL and self.disagg.is_prefill_side(params):
            for seq in seqs:  # the decode side computes this one itself
                seq.finish(FinishReason.LENGTH)
            self._finished_outside.extend(seqs)
            return
        registered = False
        try:
            if role is not KVRole.LOCAL:  # raises: room in use
                registered = self.disagg.on_add(request_id, params, prompt_ids)
            for seq in seqs:
                self.scheduler.add(seq)
        except Exception:
            self.scheduler.abort(request_id)
            if registered:
                self.disagg.on_abort(request_id)  # the connector forgets its room
            self.outputs.drop(request_id)
            raise

    def _add_resumed(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_text: str | None,
        progress: list[SampleProgress],
    ) -> None:
        if len(progress) != params.n or params.kv_transfer is not None:
            raise ValueError(
                f"a resumed request needs one progress entry per sample ({params.n}, got "
                f"{len(progress)}) and no KV transfer"
            )
        seqs = []
        for i, done in enumerate(progress):
            seq = Sequence(
                request_id=request_id,
                prompt_token_ids=prompt_ids,
                params=params,
                sample_index=i,
                eos_token_ids=self.eos_token_ids,
                max_model_len=self.max_model_len,
            )
            seq.resume_from(done)
            seqs.append(seq)
        self.outputs.add(request_id, prompt_text, prompt_ids, params, seqs)
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.add(seq, resumed=True)

    def release_groups(self) -> None:
        """Drop every handle on this rank's process groups (elastic EP, as the group fails):
        a group's connections close only once nothing holds it, and only then do the peers
        blocked on this rank fail at once instead of at their collective timeout."""
        detached = self.groups.without_handles()
        self.groups = self.model.groups = self.runner.groups = detached
        for _, block in self.model.moe_blocks():
            block.release_group()
        if self.eplb is not None:
            self.eplb.regroup(detached.ep, detached.world)

    def regroup(self, groups: ParallelGroups) -> None:
        """Take part in a new generation's groups (elastic EP: ``engine/regroup.py`` moved
        the MoE layers already); the runner and the balancer follow."""
        self.groups = groups
        self.model.groups = groups
        self.runner.groups = groups
        if self.eplb is not None:
            self.eplb.regroup(groups.ep, groups.world)
        dims = groups.dims
        self.run_empty_when_idle = dims.enable_expert_parallel and dims.dp > 1

    def drop_all_requests(self) -> list[str]:
        """Forget every request at once (an engine group lost a rank: rank 0 queues them
        again, with what their callers have received); returns their ids. Every KV block is
        free or cached afterwards."""
        ids = list(self.outputs.requests)
        for request_id in ids:
            self.abort_request(request_id)
        self._finished_outside.clear()
        return ids

    def set_disaggregation_mode(self, mode: str) -> dict:
        """Switch this instance between the prefill and decode roles (adaptive P/D): only
        when it holds no request and no transfer (its server drained it); the pool and its
        transfer-engine registration stay, the bootstrap control is replaced. A rank of an
        engine group only takes the role for the requests it is sent (its rank 0 switches
        the control: ``EngineGroup.set_disaggregation_mode``). Returns the new role's
        ``/server_info`` fields; ValueError says why it cannot switch (NotDrainedError: not
        yet). ``DisaggMode.switch`` does it."""
        return self.disagg.switch(mode, drained=not self.has_unfinished_requests())

    def validate_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range for vocab size {vocab}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; this engine's max_model_len is "
                f"{self.max_model_len}, which must leave room for at least one output token"
            )
        if params.guided_decoding is not None:  # a bad schema fails here, not in a step
            self.grammars.check(params.guided_decoding, vocab)
        cap = self.config.max_waiting_requests
        if cap is not None and params.n > cap:
            raise ValueError(
                f"n={params.n} samples can never be queued: the engine holds at most {cap} "
                "waiting sequences (--max-waiting-requests)"
            )
        if params.stop and params.detokenize and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has no tokenizer.json")

    def abort_request(self, request_id: str) -> None:
        """Drop a request at once; its KV blocks return to the pool before this returns
        (those a KV transfer may still touch, once it cannot: ``moeserve/disagg/``)."""
        self.scheduler.abort(request_id)
        self.outputs.drop(request_id)
        self.disagg.on_abort(request_id)

    def apply_kv_commands(self, cmds: dict) -> None:
        """An engine group's rank: apply the control's commands (``disagg/rank.py``) before
        the step, which reports the sequences they ended."""
        self._finished_outside += self.disagg.apply(cmds)

    def kv_events(self) -> dict:
        """An engine group's rank: what its scheduler parked and its transfers did."""
        return self.disagg.events()

    def finish_sample(self, request_id: str, index: int, stop_reason: str | None = None) -> None:
        """End one sample of a request with finish reason ``stop`` (its caller found a stop
        string in the text); its blocks are freed at once and the next step reports it."""
        self.outputs.finish_sample(request_id, index, FinishReason.STOP, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or self.outputs.has_pending
            or bool(self._finished_outside)
            or self.disagg.has_pending()
        )

    def eplb_command(self, action: str, path: str | None = None) -> dict:
        """An EPLB command on this process's balancer (``ExpertBalancer.command``):
        ``rebalance``, ``dump`` (to ``path`` or ``expert_stats_out``) or ``status``. Returns
        its result ({} without MoE layers); raises ValueError with the balancer's error, and
        RuntimeError on a rank of an engine group, whose command must run on every rank at once
        (``EngineGroup.eplb_command``)."""
        if self.groups.dims.world_size > 1:
            raise RuntimeError(
                "this engine is one rank of an engine group: run EPLB commands on every rank "
                "at once (EngineGroup.eplb_command)"
            )
        answer = run_command(self.eplb, action, path)
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer["result"] or {}

    def watch(
        self,
        on_failure: Callable[[str], None],
        on_health: Callable[[list[str], dict | None], None],
        on_stop: Callable[[str], None],
    ) -> None:
        """Nothing fails here outside the caller's own calls: the handlers are never called."""

    def announce_api(self, url: str) -> None:
        """No other rank to tell."""

    def shutdown(self) -> None:
        """A one-process engine writes its expert statistics (``expert_stats_out``) and
        closes its KV-transfer connector; it holds nothing else to release."""
        if self.eplb is not None and self.config.expert_stats_out:
            self.eplb.dump()
        self.disagg.close()

    def stats(self, self_check: bool = True) -> dict:
        """This replica's queues, KV cache and prefix-cache counters, the tokens routed to each
        expert of the MoE layers this rank reports (see :meth:`MoEBlock.reports_counts`), and
        with ``self_check`` the result of the KV-cache self-check (``integrity``: "ok" or the
        error). The self-check walks every block (milliseconds for a large pool, more than a
        decode step of a small model); without it the stats cost tens of microseconds."""
        bm = self.scheduler.block_manager
        stats = {
            "num_running": self.scheduler.num_running,
            "num_parked": self.scheduler.num_parked,
            "disaggregation": self.disagg.stats(),
            "num_waiting": self.scheduler.num_waiting,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": bm.usage,
            "num_blocks": bm.num_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_blocks": bm.num_cached_blocks,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "expert_counts": self.model.expert_counts(),
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "spec_decode_num_verify_steps": self.scheduler.num_verify_steps,
            "eplb": self.eplb.metrics() if self.eplb is not None else None,
        }
        if self_check:
            try:
                self.scheduler.check_integrity()
                stats["integrity"] = "ok"
            except AssertionError as e:
                stats["integrity"] = str(e)
        return stats

    # -- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.eplb is not None:
            self.eplb.on_step()  # count expert load; move experts during a re-placement
        ended = self._take_finished_outside()
        batch = self.scheduler.schedule()
        ended += self.disagg.poll()  # decode side: ask for what the schedule parked
        if batch is None:
            if self.run_empty_when_idle:
                self.runner.run_empty()
            elif not ended:
                self.disagg.wait_for_transfers()  # nothing to compute: KV may be in flight
            return self.outputs.process(ended)  # samples finished between steps
        results: list[SeqStepOutput] = self.runner.run(batch)
        self.outputs.record_prompt_logprobs(batch, results)
        spec = None
        if self.config.speculative_num_tokens:
            spec = [(r.more_token_ids, r.more_logprobs, r.draft_token_ids) for r in results]
        updated = self.scheduler.update(batch, [(r.token_id, r.logprobs) for r in results], spec)
        ended += self.disagg.poll()  # prefill side: send what the step computed at once
        return self.outputs.process(updated + ended)

    def _take_finished_outside(self) -> list[Sequence]:
        """Sequences that ended between steps (no-op prefill requests) and what the
        connector finished or heard since the last step."""
        ended, self._finished_outside = self._finished_outside, []
        return ended + self.disagg.poll()

    def step_with_stats(self) -> tuple[list[RequestOutput], dict]:
        """:meth:`step`, then :meth:`stats` without the self-check."""
        outputs = self.step()
        return outputs, self.stats(self_check=False)
