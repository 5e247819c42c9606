"""The engine publishes its stats on its own schedule: the rate limit alone
(:class:`SnapshotSchedule`), then the engine loop (:class:`EngineCore`) over a fake engine and
fake sockets, with a fake clock that each step advances."""

from __future__ import annotations

import pytest

from moeserve.core import CompletionOutput, RequestOutput, SamplingParams
from moeserve.serving import messages as m
from moeserve.serving.engine_core import EngineCore, SnapshotSchedule

INTERVAL = 0.5
STEP_S = 0.1


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_schedule_publishes_at_most_every_interval_and_once_when_idle():
    clock = Clock()
    s = SnapshotSchedule(INTERVAL, clock)
    assert s.due_when_idle() and s.due_with_step()  # nothing published yet
    assert s.mark_published() == 1
    assert not s.due_when_idle() and not s.due_with_step()
    clock.t += INTERVAL - 0.01
    s.touch()
    assert not s.due_with_step()  # a change does not shorten the interval of a busy engine
    assert s.due_when_idle()  # but an idle engine publishes what changed at once
    clock.t += 0.01
    assert s.due_with_step()
    assert s.mark_published() == 2
    assert not s.due_when_idle()
    clock.t += 1000.0
    assert not s.due_when_idle()  # idle and unchanged: nothing to publish, however long


class FakeEngine:
    """Requests of ``max_tokens`` steps; each step takes ``STEP_S`` on the clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.left: dict[str, int] = {}
        self.steps = 0
        self.generated = 0
        self.stats_calls: list[bool] = []

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        self.left[request_id] = params.max_tokens

    def abort_request(self, request_id: str) -> None:
        self.left.pop(request_id, None)

    def finish_sample(self, request_id: str, index: int, stop: str | None = None) -> None:
        self.left.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        self.clock.t += STEP_S
        outputs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            self.generated += 1
            done = self.left[rid] == 0
            finish = "length" if done else None
            sample = CompletionOutput(0, "", [7], None, None, finish, None)
            outputs.append(RequestOutput(rid, None, [1], [sample], done))
            if done:
                del self.left[rid]
        return outputs

    def step_with_stats(self):
        outputs = self.step()
        return outputs, self.stats(self_check=False)

    def stats(self, self_check: bool = True) -> dict:
        self.stats_calls.append(self_check)
        st = {
            "num_running": len(self.left),
            "num_waiting": 0,
            "kv_cache_usage": 0.0,
            "generated": self.generated,
            "t": self.clock.t,
            "expert_counts": {1: [self.generated, 0]},
        }
        if self_check:
            st["integrity"] = "ok"
        return st


class FakeInput:
    """Frames delivered once the engine has taken ``at`` steps; an idle poll with nothing left
    to deliver gets Shutdown (the loop's end)."""

    def __init__(self, engine: FakeEngine, frames: list[tuple[int, m.Message]]) -> None:
        self.engine = engine
        self.frames = [(at, m.encode(msg)) for at, msg in frames]

    def _ready(self) -> list[tuple[int, bytes]]:
        return [f for f in self.frames if f[0] <= self.engine.steps]

    def poll(self, timeout_ms: int) -> bool:
        if not self._ready() and timeout_ms > 0 and not self.frames:
            self.frames.append((0, m.encode(m.Shutdown())))
        return bool(self._ready())

    def recv(self, flags: int = 0) -> bytes:
        import zmq

        ready = self._ready()
        if not ready:
            raise zmq.Again()
        self.frames.remove(ready[0])
        return ready[0][1]


class FakeOutput:
    def __init__(self) -> None:
        self.sent: list[m.Message] = []

    def send(self, frame: bytes) -> None:
        self.sent.append(m.decode(frame))


def run_core(frames: list[tuple[int, m.Message]]):
    clock = Clock()
    engine = FakeEngine(clock)
    out = FakeOutput()
    core = EngineCore(
        engine, FakeInput(engine, frames), out, None, SnapshotSchedule(INTERVAL, clock)
    )
    core.run()
    return engine, out.sent


def _add(rid: str, n: int) -> m.AddRequest:
    return m.AddRequest(rid, [1], SamplingParams(max_tokens=n))


def test_a_busy_engine_publishes_at_most_every_interval_and_once_it_goes_idle():
    engine, sent = run_core([(0, _add("a", 30)), (10, _add("b", 5))])
    snaps = [msg for msg in sent if isinstance(msg, m.StatsSnapshot)]
    assert [s.seq for s in snaps] == list(range(1, len(snaps) + 1))
    assert all(call is False for call in engine.stats_calls)  # never the self-check
    # while busy: one with the first step, then one per interval (5 steps), not one per step
    busy = [s for s in snaps if s.stats["num_running"] > 0]
    times = [s.stats["t"] for s in busy]
    assert all(b - a >= INTERVAL - 1e-9 for a, b in zip(times, times[1:]))
    assert len(busy) <= engine.steps * STEP_S / INTERVAL + 1
    assert len(snaps) < engine.steps
    # the last snapshot: the idle engine's final numbers, sent before the last outputs
    last = snaps[-1]
    assert last.stats["num_running"] == 0 and last.stats["generated"] == 35
    assert last.stats["expert_counts"] == {"1": [35, 0]}  # shaped as /metrics reads it
    assert last.stats["replicas"] == [{"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}]
    final = [i for i, msg in enumerate(sent) if isinstance(msg, m.StepOutputs)][-1]
    assert sent[final].outputs[0].finished
    assert sent.index(last) == final - 1


def test_an_idle_engine_publishes_once_per_change_and_stats_calls_change_nothing():
    # idle at the start: one snapshot; three stats Calls: answered, no snapshot for them
    calls = [(0, m.Call(i, "stats")) for i in range(3)]
    engine, sent = run_core(calls)
    snaps = [msg for msg in sent if isinstance(msg, m.StatsSnapshot)]
    results = [msg for msg in sent if isinstance(msg, m.CallResult)]
    assert len(snaps) == 1
    assert [r.result["calls_received"] for r in results] == [1, 2, 3]
    assert all(r.result["integrity"] == "ok" for r in results)  # a Call runs the self-check


@pytest.mark.parametrize("message", ["abort", "finish"])
def test_a_request_ended_between_steps_is_published_once_idle(message):
    end = m.AbortRequests(["a"]) if message == "abort" else m.FinishSample("a", 0, "x")
    engine, sent = run_core([(0, _add("a", 100)), (3, end)])
    snaps = [msg for msg in sent if isinstance(msg, m.StatsSnapshot)]
    assert engine.steps == 3
    assert snaps[-1].stats["num_running"] == 0
    assert sent[-1] == snaps[-1]  # published after the message was applied, with no step


def test_the_engines_series_are_rendered_once_per_snapshot(monkeypatch):
    from prometheus_client.parser import text_string_to_metric_families

    from moeserve.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    collects = []
    real = metrics.engine.collect
    monkeypatch.setattr(metrics.engine, "collect", lambda: collects.append(1) or real())

    def samples(text: bytes) -> dict[str, float]:
        out = {}
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                out[s.name + str(sorted(s.labels.items()))] = s.value
        return out

    def stats(n: int) -> dict:
        one = {"num_running": 1, "num_waiting": 0, "kv_cache_usage": 0.5}
        counters = {"prefix_cache_queries": n, "prefix_cache_hits": 0, "num_preemptions": 0}
        return {"replicas": [one], **counters, "expert_counts": {"1": [n, 2 * n]}}

    assert "moeserve:num_requests_running" not in metrics.render().decode()  # none yet
    first = stats(3)
    metrics.set_engine_stats(first, 1, 50.0)
    metrics.generation_tokens.inc(7)
    a = samples(metrics.render())
    metrics.set_engine_stats(first, 1, 50.0)  # the same snapshot, scraped again
    metrics.generation_tokens.inc(1)
    b = samples(metrics.render())
    assert len(collects) == 1
    tokens = "moeserve:expert_tokens_total[('expert', '1'), ('layer', '1'), ('model_name', 'm')]"
    assert a[tokens] == b[tokens] == 6
    gen = "moeserve:generation_tokens_total[('model_name', 'm')]"
    assert (a[gen], b[gen]) == (7, 8)  # this server's own series: rendered at every scrape
    age = "moeserve:engine_stats_age_seconds[('model_name', 'm')]"
    assert b[age] >= a[age] > 0
    metrics.set_engine_stats(stats(4), 2, 51.0)
    c = samples(metrics.render())
    assert len(collects) == 2 and c[tokens] == 8
    assert c["moeserve:engine_stats_snapshots_total[('model_name', 'm')]"] == 2
