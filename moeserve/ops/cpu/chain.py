"""Kernel calls made by one call: a decode step's prebound calls, prepared once (``chain.c``).

A :class:`CallChain` collects calls of this package's ctypes functions (their ``argtypes``
and ``restype`` say how to pass each argument) with their arguments; :meth:`CallChain.build`
prepares them in C as libffi call interfaces, and :meth:`BuiltChain.run` makes them in
order in one ctypes call. An argument may be a :class:`Register` (one of six values the run
passes: what changes every step, such as the positions' address) or a :class:`Result` (the
return value of an earlier call of the chain). A call may fail by its return (nonzero or
negative: ``check``); the chain then stops and :meth:`BuiltChain.run` raises.

Why: from Python every call converts its arguments again, and between weight streams that
runs from cold caches (~3 us a call against ~0.1 us here; docs/benchmarks.md). The calls one
by one from Python are the reference: the same functions with the same arguments.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from pathlib import Path

from moeserve.ops.cpu import build
from moeserve.ops.cpu.build import I64, PTR

_SOURCE = Path(__file__).with_name("chain.c")
NREG = 6  # registers a run passes
NONE, NONZERO, NEGATIVE = 0, 1, 2  # what return value fails a call (check)
_KINDS = {ctypes.c_int64: 0, ctypes.c_int: 1, ctypes.c_void_p: 2, ctypes.c_float: 3}
_VOID = -1


@dataclass(frozen=True)
class Register:
    """An argument given by each run: register ``index`` (< :data:`NREG`), an int64 or
    an address."""

    index: int


@dataclass(frozen=True)
class Result:
    """An argument that is the return value of call ``call`` of the same chain (earlier)."""

    call: int


def _library() -> ctypes.CDLL | None:
    lib = build.load(_SOURCE)
    if lib is None:
        return None
    lib.moeserve_chain_new.restype = PTR
    lib.moeserve_chain_new.argtypes = [I64, *(PTR,) * 7, I64, PTR, PTR]
    lib.moeserve_chain_run.restype = I64
    lib.moeserve_chain_run.argtypes = [PTR, *(I64,) * NREG]
    lib.moeserve_chain_slots.restype = PTR
    lib.moeserve_chain_slots.argtypes = [PTR]
    build.declare(lib, "moeserve_chain_free", PTR)
    return lib


def available() -> bool:
    return _library() is not None


def _slot(kind: int, value) -> int:
    """A 64-bit slot holding ``value`` as an argument of ``kind``."""
    if kind == 3:  # float: its bits in the low bytes
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    value = 0 if value is None else int(value)
    return value & 0xFFFFFFFF if kind == 1 else value & 0xFFFFFFFFFFFFFFFF


class CallChain:
    """Calls to collect, then :meth:`build`."""

    def __init__(self) -> None:
        self._calls: list[tuple[object, tuple, int, str]] = []

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, fn, args: tuple, check: int | None = None, name: str = "") -> int:
        """Call ``fn`` (a ctypes function of this package's libraries) with ``args`` (ints,
        floats, addresses, None for a null address, :class:`Register`, :class:`Result`);
        ``check``: which return fails it (None: a nonzero one, where ``fn`` returns a value,
        as the kernels that allocate report a failure); ``name`` says which call failed.
        Returns the call's index. Raises ValueError for an argument count or type the
        function does not take."""
        argtypes = getattr(fn, "argtypes", None)
        if argtypes is None or len(argtypes) != len(args):
            raise ValueError(f"{name or fn}: {len(args)} arguments for {argtypes}")
        if any(t not in _KINDS for t in argtypes) or (
            fn.restype is not None and fn.restype not in (ctypes.c_int64, ctypes.c_int)
        ):
            raise ValueError(f"{name or fn}: argument or return types the chain cannot pass")
        for a, t in zip(args, argtypes, strict=True):
            if isinstance(a, Register | Result) and t not in (ctypes.c_int64, ctypes.c_void_p):
                raise ValueError(f"{name or fn}: a register or result must be int64 or address")
            if isinstance(a, Result) and not 0 <= a.call < len(self._calls):
                raise ValueError(f"{name or fn}: the result of call {a.call}, not an earlier one")
        if check is None:
            check = NONE if fn.restype is None else NONZERO
        self._calls.append((fn, tuple(args), check, name))
        return len(self._calls) - 1

    def build(self) -> BuiltChain | PythonChain:
        """The calls prepared in C, or where the chain library is not here (aarch64, no
        libffi) the same calls made one by one from Python (:class:`PythonChain`)."""
        lib = _library()
        if lib is None:
            return PythonChain(self._calls)
        n = len(self._calls)
        fns, nargs, kinds, values, rkinds, checks, ret_to = [], [], [], [], [], [], [-1] * n
        reg_slot, reg_index = [], []
        for fn, args, check, _ in self._calls:
            fns.append(ctypes.cast(fn, ctypes.c_void_p).value)
            nargs.append(len(args))
            rkinds.append(_VOID if fn.restype is None else _KINDS[fn.restype])
            checks.append(check)
            for a, t in zip(args, fn.argtypes, strict=True):
                kind = _KINDS[t]
                if isinstance(a, Register):
                    reg_slot.append(len(values)), reg_index.append(a.index)
                elif isinstance(a, Result):
                    ret_to[a.call] = len(values)
                kinds.append(kind)
                values.append(0 if isinstance(a, Register | Result) else _slot(kind, a))
        arrays = (
            (ctypes.c_int64 * n)(*fns),
            (ctypes.c_int64 * n)(*nargs),
            (ctypes.c_int8 * len(kinds))(*kinds),
            (ctypes.c_uint64 * len(values))(*values),
            (ctypes.c_int8 * n)(*rkinds),
            (ctypes.c_int64 * n)(*ret_to),
            (ctypes.c_int8 * n)(*checks),
        )
        regs = ((ctypes.c_int64 * len(reg_slot))(*reg_slot),
                (ctypes.c_int64 * len(reg_index))(*reg_index))  # fmt: skip
        handle = lib.moeserve_chain_new(n, *arrays, len(reg_slot), *regs)
        if not handle:
            raise MemoryError(f"a chain of {n} calls could not be prepared")
        return BuiltChain(lib, handle, self._calls, len(values))


class BuiltChain:
    """Prepared calls; :meth:`run` makes them. Frees its C side when collected."""

    def __init__(self, lib: ctypes.CDLL, handle: int, calls: list, n_slots: int) -> None:
        self._lib, self._handle = lib, handle
        self.names = [name for *_, name in calls]
        self.checks = [check for _, _, check, _ in calls]
        self._run = lib.moeserve_chain_run
        self.n_slots = n_slots

    def run(self, *registers: int) -> None:
        """Every call in order, ``registers`` (up to :data:`NREG`) in their slots first.
        Raises :class:`ChainError` naming the call whose return failed (the calls after it
        were not made)."""
        failed = self._run(self._handle, *registers, *(0,) * (NREG - len(registers)))
        if failed >= 0:
            raise ChainError(failed, self.names[failed], self.checks[failed])

    def slots(self) -> list[int]:
        """Every argument slot's value now (tests)."""
        ptr = self._lib.moeserve_chain_slots(self._handle)
        return list((ctypes.c_uint64 * self.n_slots).from_address(ptr))

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.moeserve_chain_free(handle)


class PythonChain:
    """The calls of a :class:`CallChain` made one by one from Python, as a :class:`BuiltChain`
    makes them in C: the reference, and where the chain library is not built."""

    def __init__(self, calls: list[tuple[object, tuple, int, str]]) -> None:
        self._calls = list(calls)
        self.names = [name for *_, name in calls]

    def run(self, *registers: int) -> None:
        """As :meth:`BuiltChain.run`."""
        results: dict[int, int] = {}
        for i, (fn, args, check, name) in enumerate(self._calls):
            values = [
                registers[a.index] if isinstance(a, Register)
                else results[a.call] if isinstance(a, Result)
                else a
                for a in args
            ]  # fmt: skip
            ret = fn(*values)
            v = 0 if ret is None else int(ret)
            if (check == NONZERO and v != 0) or (check == NEGATIVE and v < 0):
                raise ChainError(i, name, check)
            results[i] = v


class ChainError(RuntimeError):
    """Call ``index`` of a chain (``name``) failed its ``check`` (:data:`NONZERO`: the kernels
    that allocate report no memory so; :data:`NEGATIVE`: the MoE sort reports an expert id
    outside its slots)."""

    def __init__(self, index: int, name: str, check: int) -> None:
        super().__init__(f"call {index} of the chain ({name or 'unnamed'}) failed")
        self.index, self.name, self.check = index, name, check
