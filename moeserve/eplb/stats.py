"""Expert-load statistics: tokens routed to each logical expert of each MoE layer, over a
sliding window of steps, and the files that carry them (or a placement) between runs.

Shape legend: L MoE layers, E logical experts, P physical slots, C closed chunks in the window.

The window is a ring of ``C = window_steps / chunk_steps`` closed chunks plus one open chunk
that the current steps add into::

    chunks_CLE  [ c0 | c1 | ... | open | ... ]   ring of C + 1 slots of [L, E] int64
                  closing the open chunk (every chunk_steps steps) zeroes the oldest closed
                  one, which becomes the next open chunk

so the window holds the last ``C * chunk_steps`` completed steps plus the open chunk's
(between ``window_steps`` and ``window_steps + chunk_steps - 1``; exactly the last
``window_steps`` with ``chunk_steps=1``). Adding a step's counts is one in-place ``[L, E]`` add.

Files (``--expert-stats-out FILE``, ``--init-expert-location FILE``): ``.json`` or
``.safetensors`` (chosen by the suffix; never pickle), holding either

    raw stats    format "moeserve.expert_stats":     load [L, E] int64, steps
    a placement  format "moeserve.expert_placement": phy2log [L, P] int64

each with ``layer_ids`` (the model layer of each row) when known.
:func:`load_expert_location` tells them apart and checks their shapes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moeserve.eplb.algorithm import placement_tables

STATS_FORMAT = "moeserve.expert_stats"
PLACEMENT_FORMAT = "moeserve.expert_placement"
FILE_VERSION = 1


class ExpertLoadStats:
    """Sliding-window token counts per layer and logical expert.

    Per step: any number of :meth:`add` / :meth:`add_layer` / :meth:`add_totals` calls, then
    :meth:`step`. :meth:`window` sums the window over ``group`` (``torch.distributed``
    all-reduce; ``None`` means this process alone), so with a group every rank must call it
    together. Raises ValueError on wrong shapes or sizes.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window_steps: int = 1000,
        chunk_steps: int = 10,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"need >= 1 layer and expert, got {num_layers}, {num_experts}")
        if chunk_steps < 1 or window_steps < chunk_steps or window_steps % chunk_steps:
            raise ValueError(
                f"window_steps={window_steps} must be a positive multiple of "
                f"chunk_steps={chunk_steps}"
            )
        self.num_layers, self.num_experts = num_layers, num_experts
        self.window_steps, self.chunk_steps = window_steps, chunk_steps
        self.group = group
        self.num_chunks = window_steps // chunk_steps
        self._chunks_CLE = torch.zeros(
            self.num_chunks + 1, num_layers, num_experts, dtype=torch.int64, device=device
        )
        self._open = 0  # ring index of the open chunk
        self._open_steps = 0  # completed steps in the open chunk
        self._closed = 0  # closed chunks in the ring (up to num_chunks)
        self._last_totals_LE: torch.Tensor | None = None
        self.steps = 0  # completed steps since the start

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_layers, self.num_experts)

    def add(self, counts_LE: torch.Tensor) -> None:
        """Add one step's tokens per layer and expert (``[L, E]``, integer)."""
        if tuple(counts_LE.shape) != self.shape:
            raise ValueError(
                f"counts must be {self.shape} (layers, experts), got {tuple(counts_LE.shape)}"
            )
        self._chunks_CLE[self._open].add_(counts_LE)

    def add_layer(self, layer: int, counts_E: torch.Tensor) -> None:
        """Add one layer's counts (``[E]``); ``layer`` indexes the MoE layers, from 0."""
        if not 0 <= layer < self.num_layers or tuple(counts_E.shape) != (self.num_experts,):
            raise ValueError(
                f"need layer in [0, {self.num_layers}) and counts of shape "
                f"({self.num_experts},), got layer {layer}, {tuple(counts_E.shape)}"
            )
        self._chunks_CLE[self._open, layer].add_(counts_E)

    def add_totals(self, totals_LE: torch.Tensor) -> None:
        """Add what monotone since-start counters (``MoEBlock.expert_counts_E`` stacked) gained
        since the previous call; the first call counts everything since they started at 0.
        Raises ValueError when a counter went down (counters reset: call :meth:`reset`)."""
        if tuple(totals_LE.shape) != self.shape:
            raise ValueError(
                f"totals must be {self.shape} (layers, experts), got {tuple(totals_LE.shape)}"
            )
        totals_LE = totals_LE.to(self._chunks_CLE.device, torch.int64)
        last = self._last_totals_LE
        delta_LE = totals_LE if last is None else totals_LE - last
        if (delta_LE < 0).any():
            raise ValueError(
                "expert counters went down since the last add_totals; after "
                "resetting them, call reset()"
            )
        self.add(delta_LE)
        self._last_totals_LE = totals_LE.clone()

    def step(self) -> None:
        """End a step; every ``chunk_steps`` steps the open chunk closes and the oldest
        closed chunk leaves the window."""
        self.steps += 1
        self._open_steps += 1
        if self._open_steps == self.chunk_steps:
            self._open = (self._open + 1) % (self.num_chunks + 1)
            self._chunks_CLE[self._open].zero_()
            self._open_steps = 0
            self._closed = min(self._closed + 1, self.num_chunks)

    def closes_chunk(self) -> bool:
        """Whether the next :meth:`step` closes the open chunk."""
        return self._open_steps + 1 == self.chunk_steps

    @property
    def window_covers_steps(self) -> int:
        """Completed steps the window holds now."""
        return self._closed * self.chunk_steps + self._open_steps

    def local_window(self) -> torch.Tensor:
        """``[L, E]`` int64: this process's own counts over the window (no communication)."""
        return self._chunks_CLE.sum(0)

    def window(self) -> torch.Tensor:
        """``[L, E]`` int64: tokens per layer and expert over the window, summed over the
        group when there is one (a collective)."""
        load_LE = self.local_window()
        if self.group is not None:
            dist.all_reduce(load_LE, op=dist.ReduceOp.SUM, group=self.group)
        return load_LE

    def reset(self) -> None:
        """Forget everything (counters restart at 0 for :meth:`add_totals`)."""
        self._chunks_CLE.zero_()
        self._open = self._open_steps = self._closed = self.steps = 0
        self._last_totals_LE = None


@dataclass(frozen=True, eq=False)
class ExpertStatsFile:
    """Raw statistics: tokens per layer and logical expert over ``steps`` steps."""

    load_LE: torch.Tensor
    steps: int | None = None
    layer_ids: tuple[int, ...] | None = None


@dataclass(frozen=True, eq=False)
class ExpertPlacementFile:
    """A placement: the logical expert of every physical slot of every layer."""

    phy2log_LP: torch.Tensor
    layer_ids: tuple[int, ...] | None = None


def save_expert_stats(
    path: str | Path,
    load_LE: torch.Tensor,
    steps: int | None = None,
    layer_ids: list[int] | tuple[int, ...] | None = None,
) -> None:
    """Write raw stats (``.json`` or ``.safetensors``)."""
    load_LE = _int_table(load_LE, "load")
    meta = {"steps": steps} if steps is not None else {}
    _write(Path(path), STATS_FORMAT, "load", load_LE, meta, layer_ids)


def save_placement(
    path: str | Path,
    phy2log_LP: torch.Tensor,
    layer_ids: list[int] | tuple[int, ...] | None = None,
) -> None:
    """Write a placement (``.json`` or ``.safetensors``)."""
    _write(
        Path(path), PLACEMENT_FORMAT, "phy2log", _int_table(phy2log_LP, "phy2log"), {}, layer_ids
    )


def load_expert_location(
    path: str | Path,
    num_layers: int,
    num_experts: int,
    num_physical: int | None = None,
    layer_ids: list[int] | tuple[int, ...] | None = None,
) -> ExpertStatsFile | ExpertPlacementFile:
    """Read a stats or placement file and check it fits the model: ``load [num_layers,
    num_experts]``, or ``phy2log [num_layers, P]`` with ``P == num_physical`` (when given,
    else ``P >= num_experts``), ids in ``[0, num_experts)`` and every expert present; the
    file's ``layer_ids`` (if any) must equal ``layer_ids`` (if given).

    Raises FileNotFoundError for a missing file and ValueError for anything else wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"expert location file {path}: not found")
    fmt, table, meta = _read(path)
    ids = meta.get("layer_ids")
    file_layers = tuple(int(i) for i in ids) if ids is not None else None
    if layer_ids is not None and file_layers is not None and tuple(layer_ids) != file_layers:
        raise ValueError(
            f"{path}: rows are for model layers {list(file_layers)}, this model's MoE layers "
            f"are {list(layer_ids)}"
        )
    if fmt == STATS_FORMAT:
        if tuple(table.shape) != (num_layers, num_experts):
            raise ValueError(
                f"{path}: stats of shape {tuple(table.shape)}, this model needs "
                f"({num_layers}, {num_experts}) (MoE layers, logical experts)"
            )
        if (table < 0).any():
            raise ValueError(f"{path}: negative token counts")
        steps = meta.get("steps")
        return ExpertStatsFile(table, int(steps) if steps is not None else None, file_layers)
    L, P = table.shape
    want_P = f"{num_physical}" if num_physical is not None else f">= {num_experts}"
    if L != num_layers or (P != num_physical if num_physical is not None else P < num_experts):
        raise ValueError(
            f"{path}: placement of shape {(L, P)}, this model needs ({num_layers}, {want_P}) "
            "(MoE layers, physical slots = experts + redundant experts)"
        )
    try:
        placement_tables(table, num_experts)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return ExpertPlacementFile(table, file_layers)


def _int_table(t: torch.Tensor, name: str) -> torch.Tensor:
    t = torch.as_tensor(t)
    if t.dim() != 2 or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{name} must be a 2-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    return t.detach().to("cpu", torch.int64).contiguous()


def _write(path: Path, fmt: str, key: str, table, meta: dict, layer_ids) -> None:
    if layer_ids is not None:
        layer_ids = [int(i) for i in layer_ids]
        if len(layer_ids) != table.shape[0]:
            raise ValueError(f"{len(layer_ids)} layer ids for {table.shape[0]} rows")
        meta = {**meta, "layer_ids": layer_ids}
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        record = {"format": fmt, "version": FILE_VERSION, **meta, key: table.tolist()}
        path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    elif path.suffix == ".safetensors":
        from safetensors.torch import save_file

        header = {"format": fmt, "version": str(FILE_VERSION)}
        header.update({k: json.dumps(v) for k, v in meta.items()})
        save_file({key: table}, str(path), metadata=header)
    else:
        raise ValueError(f"{path}: use a .json or .safetensors file name")


def _read(path: Path) -> tuple[str, torch.Tensor, dict]:
    """``(format, table, meta)``; the table is a 2-D int64 tensor."""
    keys = {STATS_FORMAT: "load", PLACEMENT_FORMAT: "phy2log"}
    if path.suffix == ".json":
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: expected a JSON object")
        meta = record
        raw = record.get(keys.get(record.get("format"), ""))
    elif path.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header = f.metadata() or {}
                key = keys.get(header.get("format"), "")
                raw = f.get_tensor(key) if key in f.keys() else None
        except SafetensorError as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
        meta = {k: (v if k in ("format", "version") else json.loads(v)) for k, v in header.items()}
    else:
        raise ValueError(f"{path}: use a .json or .safetensors file name")
    fmt = meta.get("format")
    if fmt not in keys:
        raise ValueError(
            f"{path}: format {fmt!r} is neither {STATS_FORMAT!r} (raw stats) nor "
            f"{PLACEMENT_FORMAT!r} (a placement)"
        )
    if str(meta.get("version")) != str(FILE_VERSION):
        raise ValueError(f"{path}: version {meta.get('version')!r}, expected {FILE_VERSION}")
    if raw is None:
        raise ValueError(f"{path}: a {fmt} file without its {keys[fmt]!r} table")
    try:
        table = torch.as_tensor(raw)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path}: {keys[fmt]!r} is not a rectangular table ({e})") from None
    if table.dim() != 2 or table.is_floating_point() or table.dtype == torch.bool:
        raise ValueError(
            f"{path}: {keys[fmt]!r} must be a 2-D table of integers, got {table.dtype} "
            f"{tuple(table.shape)}"
        )
    return fmt, table.to(torch.int64), meta
