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
from array import array
from dataclasses import dataclass
from numbers import Integral
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


def _float_bits(value) -> int:
    """A float argument's slot: its fp32 bits in the low bytes."""
    return struct.unpack("<I", struct.pack("<f", float(value)))[0]


# id(fn) -> (fn, argument kinds, return kind, address): a function's signature, checked once
_SIGNATURES: dict[int, tuple] = {}


def _signature(fn, name: str) -> tuple[tuple[int, ...], int]:
    """``(argument kinds, return kind)`` of a ctypes function; ValueError for one the chain
    cannot call."""
    known = _SIGNATURES.get(id(fn))
    if known is not None and known[0] is fn:
        return known[1], known[2]
    argtypes, restype = getattr(fn, "argtypes", None), getattr(fn, "restype", None)
    if argtypes is None:
        raise ValueError(f"{name or fn}: not a ctypes function with arguments declared")
    if any(t not in _KINDS for t in argtypes) or (
        restype is not None and restype not in (ctypes.c_int64, ctypes.c_int)
    ):
        raise ValueError(f"{name or fn}: argument or return types the chain cannot pass")
    kinds = tuple(_KINDS[t] for t in argtypes)
    rkind = _VOID if restype is None else _KINDS[restype]
    _SIGNATURES[id(fn)] = (fn, kinds, rkind, None)
    return kinds, rkind


def _function_address(fn) -> int:
    """The C address of a ctypes function (found once)."""
    known = _SIGNATURES[id(fn)]
    if known[3] is None:
        known = _SIGNATURES[id(fn)] = (*known[:3], ctypes.cast(fn, ctypes.c_void_p).value)
    return known[3]


class CallChain:
    """Calls to collect, then :meth:`build`."""

    def __init__(self) -> None:
        # (fn, args, check, name, argument kinds, return kind, the arguments that are not
        # plain ints or sit where a float goes: (position, value))
        self._calls: list[tuple] = []

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, fn, args: tuple, check: int | None = None, name: str = "") -> int:
        """Call ``fn`` (a ctypes function of this package's libraries) with ``args`` (ints,
        floats, addresses, None for a null address, :class:`Register`, :class:`Result`);
        ``check``: which return fails it (None: a nonzero one, where ``fn`` returns a value,
        as the kernels that allocate report a failure); ``name`` says which call failed.
        Returns the call's index. Raises ValueError for an argument count or type the
        function does not take."""
        kinds, rkind = _signature(fn, name)
        if len(kinds) != len(args):
            raise ValueError(f"{name or fn}: {len(args)} arguments for {len(kinds)}")
        odd = [(i, a) for i, a in enumerate(args) if type(a) is not int or kinds[i] == 3]
        for i, a in odd:
            if isinstance(a, Register | Result) and kinds[i] not in (0, 2):
                raise ValueError(f"{name or fn}: a register or result must be int64 or address")
            if isinstance(a, Result) and not 0 <= a.call < len(self._calls):
                raise ValueError(f"{name or fn}: the result of call {a.call}, not an earlier one")
            if not (a is None or kinds[i] == 3 or isinstance(a, Register | Result | Integral)):
                raise ValueError(f"{name or fn}: argument {i} ({a!r}) is not an integer")
        if check is None:
            check = NONE if rkind == _VOID else NONZERO
        self._calls.append((fn, tuple(args), check, name, kinds, rkind, odd))
        return len(self._calls) - 1

    def build(self) -> BuiltChain | PythonChain:
        """The calls prepared in C, or where the chain library is not here (aarch64, no
        libffi) the same calls made one by one from Python (:class:`PythonChain`)."""
        lib = _library()
        if lib is None:
            return PythonChain(self._calls)
        calls, n = self._calls, len(self._calls)
        values = [a for c in calls for a in c[1]]  # mostly ints already: a slot each
        kinds = array("b", [k for c in calls for k in c[4]])
        ret_to, reg_slot, reg_index, base = [-1] * n, [], [], 0
        for c in calls:
            for i, a in c[6]:
                j = base + i
                if isinstance(a, Register):
                    values[j] = 0
                    reg_slot.append(j), reg_index.append(a.index)
                elif isinstance(a, Result):
                    values[j], ret_to[a.call] = 0, j
                elif c[4][i] == 3:
                    values[j] = _float_bits(a)
                else:
                    values[j] = 0 if a is None else int(a)
            base += len(c[1])
        slots = array("q", values)  # an address fits (below 2^63 in user space)
        small = [array("q", [_function_address(c[0]) for c in calls])]
        small += [array("q", [len(c[1]) for c in calls]), array("b", [c[5] for c in calls])]
        small += [array("q", ret_to), array("b", [c[2] for c in calls])]
        regs = [array("q", reg_slot or [0]), array("q", reg_index or [0])]
        fns, nargs, rkinds, rets, checks = (_address(x) for x in small)
        handle = lib.moeserve_chain_new(
            n, fns, nargs, _address(kinds), _address(slots), rkinds, rets, checks,
            len(reg_slot), *(_address(x) for x in regs),
        )  # fmt: skip
        if not handle:
            raise MemoryError(f"a chain of {n} calls could not be prepared")
        return BuiltChain(lib, handle, calls, len(values))


def _address(a: array) -> int:
    return a.buffer_info()[0]


class BuiltChain:
    """Prepared calls; :meth:`run` makes them. Frees its C side when collected."""

    def __init__(self, lib: ctypes.CDLL, handle: int, calls: list, n_slots: int) -> None:
        self._lib, self._handle = lib, handle
        self.names = [c[3] for c in calls]
        self.checks = [c[2] for c in calls]
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
            try:
                self._lib.moeserve_chain_free(handle)
            except (AttributeError, TypeError):  # interpreter shutdown: the library is gone
                pass


class PythonChain:
    """The calls of a :class:`CallChain` made one by one from Python, as a :class:`BuiltChain`
    makes them in C: the reference, and where the chain library is not built."""

    def __init__(self, calls: list[tuple]) -> None:
        self._calls = [c[:4] for c in calls]
        self.names = [c[3] for c in calls]

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
