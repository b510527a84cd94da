"""Point-to-point transfers as data: :class:`Transfer`, :class:`Step`, :class:`Message`, and the
compact :class:`TransferTable` that built schedules keep their transfers in.

Schedules built by :func:`~partir_emu.collectives.algorithms.build_schedule`
keep their transfers in a :class:`TransferTable` (flat numpy arrays, one row per
transfer, rows of a step contiguous); their ``steps`` is then a :class:`TableSteps`,
a read-only sequence that makes :class:`Step` objects on demand, so a schedule
over 1024 members with millions of transfers costs tens of MB, not GB.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Transfer:
    """Chunks ``chunk .. chunk+count-1`` (``nbytes`` in all) sent from position ``src`` to ``dst``.

    ``reduce=True``: the destination adds them into its accumulator; ``False``: it stores them.
    """

    src: int
    dst: int
    nbytes: int
    chunk: int
    reduce: bool
    count: int = 1

    @property
    def chunks(self) -> range:
        return range(self.chunk, self.chunk + self.count)


@dataclass(frozen=True, slots=True)
class Step:
    """Transfers that may all run concurrently."""

    transfers: tuple[Transfer, ...]


@dataclass(frozen=True, slots=True)
class Message:
    """The transfers of one step between one ``(src, dst)`` pair, sent together."""

    src: int
    dst: int
    nbytes: int
    transfers: tuple[Transfer, ...]


class TransferTable:
    """Every transfer of a schedule as flat arrays: row ``i`` is one :class:`Transfer`, the rows of
    step ``s`` are ``ptr[s] .. ptr[s+1]-1`` in step order.

    ``nbytes`` is stored, or derived from ``prefix`` (cumulative chunk bytes by chunk id) when the
    table was built from chunk sizes (it is then computed on access, not kept).
    """

    __slots__ = ("ptr", "src", "dst", "chunk", "count", "reduce", "_nbytes", "_prefix")

    def __init__(self, ptr: np.ndarray, src: np.ndarray, dst: np.ndarray, chunk: np.ndarray, count: np.ndarray,
                 reduce: np.ndarray, nbytes: np.ndarray | None = None, prefix: np.ndarray | None = None):
        if nbytes is None and prefix is None:
            raise ValueError("TransferTable needs nbytes or the chunk prefix sums")
        self.ptr = np.asarray(ptr, np.int64)
        self.src, self.dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
        self.chunk, self.count = np.asarray(chunk, np.int32), np.asarray(count, np.int32)
        self.reduce = np.asarray(reduce, bool)
        self._nbytes = None if nbytes is None else np.asarray(nbytes, np.int64)
        self._prefix = None if prefix is None else np.asarray(prefix, np.int64)
        for a in (self.ptr, self.src, self.dst, self.chunk, self.count, self.reduce):
            a.flags.writeable = False

    @classmethod
    def from_steps(cls, steps: Sequence[Step]) -> TransferTable:
        rows = [(t.src, t.dst, t.chunk, t.count, t.reduce, t.nbytes) for st in steps for t in st.transfers]
        ptr = np.zeros(len(steps) + 1, np.int64)
        np.cumsum([len(st.transfers) for st in steps], out=ptr[1:])
        a = np.array(rows, np.int64).reshape(-1, 6)
        return cls(ptr, a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4].astype(bool), nbytes=a[:, 5])

    @property
    def num_steps(self) -> int:
        return len(self.ptr) - 1

    def __len__(self) -> int:
        return len(self.src)

    @property
    def nbytes(self) -> np.ndarray:
        """Bytes of every transfer (int64)."""
        if self._nbytes is not None:
            return self._nbytes
        assert self._prefix is not None   # why: __init__ refuses a table with neither nbytes nor prefix
        end = self.chunk.astype(np.int64) + self.count
        return self._prefix[end] - self._prefix[self.chunk]

    def step_of(self) -> np.ndarray:
        """The step of every row."""
        return np.repeat(np.arange(self.num_steps, dtype=np.int64), np.diff(self.ptr))

    def step(self, s: int) -> Step:
        lo, hi = int(self.ptr[s]), int(self.ptr[s + 1])
        if self._nbytes is not None:
            nb = self._nbytes[lo:hi].tolist()
        else:
            assert self._prefix is not None   # why: __init__ refuses a table with neither nbytes nor prefix
            c = self.chunk[lo:hi].astype(np.int64)
            nb = (self._prefix[c + self.count[lo:hi]] - self._prefix[c]).tolist()
        return Step(tuple(map(Transfer, self.src[lo:hi].tolist(), self.dst[lo:hi].tolist(), nb,
                              self.chunk[lo:hi].tolist(), self.reduce[lo:hi].tolist(), self.count[lo:hi].tolist())))

    def same(self, other: TransferTable) -> bool:
        return (self is other or (len(self) == len(other) and np.array_equal(self.ptr, other.ptr)
                                  and all(np.array_equal(getattr(self, f), getattr(other, f))
                                          for f in ("src", "dst", "chunk", "count", "reduce"))
                                  and np.array_equal(self.nbytes, other.nbytes)))

    def __getstate__(self):
        return tuple(getattr(self, f) for f in self.__slots__)

    def __setstate__(self, state) -> None:
        for f, v in zip(self.__slots__, state):
            setattr(self, f, v)


_MATERIALIZE_MAX = 200_000  # lazily built steps are kept once made if the schedule has at most this many transfers


class TableSteps(Sequence):
    """``steps`` of a schedule stored as a :class:`TransferTable`: behaves as the tuple of
    :class:`Step` (indexing, slicing to a tuple, iteration, ``==`` with tuples, hashing), making
    the Step objects on demand."""

    def __init__(self, table: TransferTable):
        self.table = table
        self._steps: tuple[Step, ...] | None = None

    def __len__(self) -> int:
        return self.table.num_steps

    def _all(self) -> tuple[Step, ...]:
        if self._steps is not None:
            return self._steps
        steps = tuple(self.table.step(s) for s in range(len(self)))
        if len(self.table) <= _MATERIALIZE_MAX:
            self._steps = steps
        return steps

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self._all()[i]) if self._steps is not None else \
                tuple(self.table.step(s) for s in range(len(self))[i])
        if self._steps is not None:
            return self._steps[i]
        n = len(self)
        i = int(i)
        if not -n <= i < n:
            raise IndexError("step index out of range")
        return self.table.step(i % n)

    def __iter__(self) -> Iterator[Step]:
        if self._steps is not None or len(self.table) <= _MATERIALIZE_MAX:
            return iter(self._all())
        return (self.table.step(s) for s in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TableSteps):
            return self.table.same(other.table)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other):
        return tuple(self) + tuple(other)

    def __radd__(self, other):
        return tuple(other) + tuple(self)

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __getstate__(self):
        return self.table

    def __setstate__(self, table) -> None:
        self.table, self._steps = table, None
