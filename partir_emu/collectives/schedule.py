"""A collective algorithm as plain data: steps of point-to-point transfers.

A :class:`CollectiveSchedule` is what every consumer of a collective reads: the
local executor (:mod:`partir_emu.collectives.local`) and the MPI executor
(:mod:`partir_emu.mpi.ranks.collectives`) move real data exactly as it says, the
analytical model prices it and the DES replays it.

**Chunks.** The data a collective moves is cut into ``num_chunks`` chunks of
``chunk_bytes[c]`` bytes. A transfer carries the run of chunks ``chunk ..
chunk + count - 1`` (``count`` is 1 unless an algorithm moves a whole
contiguous range at once, as torus and hierarchical phases do).

The logical buffer is cut into ``num_chunks`` *pieces* in buffer order;
``layout[k]`` is the chunk id of piece ``k`` (identity when ``layout`` is
empty). Algorithms number chunks so that what they move together is a run of
ids. Which pieces a member starts with and which it must end with depend on
``kind`` (``p`` members, ``m = num_chunks // p`` pieces per block, except for
all_to_all where ``m = num_chunks // p**2``):

=====================  ===================================  ===================================
kind                   member ``i`` starts with             member ``i`` ends with (its output)
=====================  ===================================  ===================================
all_gather             pieces of block ``i``                all pieces, in order
reduce_scatter         all pieces (its own contribution)    pieces of block ``i``, fully reduced
all_reduce             all pieces (its own contribution)    all pieces, fully reduced
all_to_all             pieces ``(i*p + j)*m + h`` (all j)    pieces ``(k*p + i)*m + h`` for all k
collective_permute     piece ``i`` (its whole buffer)       piece ``s`` if ``(s, i)`` is a pair,
                                                            else zeros
=====================  ===================================  ===================================

Block ``b`` is pieces ``b*m .. b*m + m - 1``; the pieces a member starts or
ends with tile its input or output buffer in the order listed.

**Semantics of a step** (both executors implement exactly this, so their
results agree bit for bit): every transfer of a step sends the value its
source holds *at the start of the step*; then the received values are applied
in the order of ``Step.transfers``: ``reduce=True`` sets
``acc = op(acc, received)``, ``reduce=False`` overwrites. The reduction order
is therefore fixed by the schedule alone.

**Empty chunks.** When the data does not divide evenly (an all_reduce of a
scalar over 8 members) some chunks have 0 bytes. They count as held by every
member and are skipped inside a run; no transfer of 0 bytes is ever emitted.

**Messages.** Transfers of one step with the same ``(src, dst)`` travel as one
message; price :meth:`CollectiveSchedule.messages`, not single transfers.

**Storage.** Schedules built by :func:`~partir_emu.collectives.algorithms.build_schedule`
keep their transfers in a :class:`~partir_emu.collectives.transfers.TransferTable`
(flat arrays; ``steps`` then makes :class:`Step` objects on demand).
:meth:`CollectiveSchedule.table` gives the arrays of any schedule (the executors
read only those).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partir_emu.collectives.transfers import Message, Step, TableSteps, Transfer, TransferTable
from partir_emu.core.spmd import check_pairs
from partir_emu.errors import CollectiveError

KINDS: tuple[str, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
REDUCE_KINDS: frozenset[str] = frozenset({"reduce_scatter", "all_reduce"})
_JSON_FORMAT = "partir_emu.collective_schedule"
_JSON_VERSION = 1


@dataclass(frozen=True)
class CollectiveSchedule:
    """A collective over a group of ``p = prod(group_shape)`` members as steps of transfers.

    ``nbytes`` is the full buffer per device: the gathered *output* for
    all_gather, the *input* for every other kind. ``algorithm`` names the
    algorithm actually used (after any fallback, e.g. ``'ring'`` for a
    ``'recursive'`` request on 6 members, ``'pairwise'``/``'direct'`` for
    all_to_all and collective_permute).
    """

    kind: str
    algorithm: str
    group_shape: tuple[int, ...]
    nbytes: int
    num_chunks: int
    steps: tuple[Step, ...] | TableSteps     # TableSteps: the same steps, made on demand from a table
    chunk_bytes: tuple[int, ...] = ()
    itemsize: int = 1
    permutation: tuple[tuple[int, int], ...] | None = None
    layout: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise CollectiveError(f"unknown collective kind {self.kind!r}; use one of {KINDS}")
        if not self.group_shape or any(int(d) < 1 for d in self.group_shape):
            raise CollectiveError(f"group_shape {self.group_shape!r} must be a non-empty tuple of positive sizes")
        p = math.prod(self.group_shape)
        per = p * p if self.kind == "all_to_all" else p
        if self.num_chunks < 1 or self.num_chunks % per:
            raise CollectiveError(
                f"{self.kind} schedule over {p} members has num_chunks={self.num_chunks}; "
                f"it must be a positive multiple of {per}")
        if len(self.chunk_bytes) != self.num_chunks or any(b < 0 for b in self.chunk_bytes):
            raise CollectiveError(
                f"chunk_bytes has {len(self.chunk_bytes)} entries for num_chunks={self.num_chunks}; "
                "give one non-negative size per chunk")
        if self.itemsize < 1 or self.nbytes < 0 or self.nbytes % self.itemsize:
            raise CollectiveError(f"nbytes={self.nbytes} is not a whole number of items of itemsize={self.itemsize}")
        if (self.kind == "collective_permute") != (self.permutation is not None):
            raise CollectiveError("a permutation is required for collective_permute and only for it")
        if self.layout and sorted(self.layout) != list(range(self.num_chunks)):
            raise CollectiveError(f"layout must be a permutation of the {self.num_chunks} chunk ids (or empty)")

    def __hash__(self) -> int:
        # equal schedules have equal headers; hashing the steps would cost a pass over every transfer
        return hash((self.kind, self.algorithm, self.group_shape, self.nbytes, self.num_chunks, self.itemsize,
                     self.permutation))

    def table(self) -> TransferTable:
        """All transfers as flat arrays: the table behind ``steps`` for built schedules, else made from
        the Step objects on each call (schedules written by hand or read from JSON are small)."""
        if isinstance(self.steps, TableSteps):
            return self.steps.table
        return TransferTable.from_steps(self.steps)

    # ----------------------------------------------------------------- sizes
    @property
    def p(self) -> int:
        """Number of members."""
        return math.prod(self.group_shape)

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def input_nbytes(self) -> int:
        """Bytes of each member's input buffer."""
        return self.nbytes // self.p if self.kind == "all_gather" else self.nbytes

    @property
    def output_nbytes(self) -> int:
        """Bytes of each member's output buffer."""
        return self.nbytes // self.p if self.kind == "reduce_scatter" else self.nbytes

    @property
    def _sub(self) -> int:
        """Pieces per block (per block pair for all_to_all)."""
        return self.num_chunks // (self.p * self.p if self.kind == "all_to_all" else self.p)

    def _pieces(self, pieces) -> tuple[int, ...]:
        lay = self.layout
        return tuple(lay[k] for k in pieces) if lay else tuple(pieces)

    def input_chunks(self, pos: int) -> tuple[int, ...]:
        """Chunks member ``pos`` starts with, in the order they tile its input."""
        p, m = self.p, self._sub
        if self.kind == "all_gather":
            return self._pieces(range(pos * m, (pos + 1) * m))
        if self.kind in REDUCE_KINDS:
            return self._pieces(range(self.num_chunks))
        if self.kind == "all_to_all":
            return self._pieces(range(pos * p * m, (pos + 1) * p * m))
        return (pos,)

    def output_chunks(self, pos: int) -> tuple[int, ...] | None:
        """Chunks member ``pos`` ends with, in output order (``None``: output is zeros)."""
        p, m = self.p, self._sub
        if self.kind in ("all_gather", "all_reduce"):
            return self._pieces(range(self.num_chunks))
        if self.kind == "reduce_scatter":
            return self._pieces(range(pos * m, (pos + 1) * m))
        if self.kind == "all_to_all":
            return self._pieces((k * p + pos) * m + h for k in range(p) for h in range(m))
        for s, d in self.permutation or ():
            if d == pos:
                return (s,)
        return None

    def touching(self, positions: Sequence[int]) -> list[list[int]]:
        """Per step, the indices (in order) of the transfers from or to any of ``positions``.

        Lets an executor that hosts a few members skip the rest of a large schedule.
        """
        tab = self.table()
        pos = np.zeros(self.p, bool)
        pos[[int(x) for x in positions if 0 <= int(x) < self.p]] = True
        hit = np.flatnonzero(pos[tab.src] | pos[tab.dst])
        step = np.searchsorted(tab.ptr, hit, side="right") - 1
        cuts = np.searchsorted(step, np.arange(1, self.num_steps))
        return [part.tolist() for part in np.split(hit - tab.ptr[step], cuts)] if self.num_steps else []

    # ------------------------------------------------------------- traffic
    def total_bytes_sent(self) -> int:
        """Bytes sent by all members over all steps."""
        return int(self.table().nbytes.sum())

    def bytes_sent_by(self, pos: int) -> int:
        tab = self.table()
        return int(tab.nbytes[tab.src == pos].sum())

    def bytes_received_by(self, pos: int) -> int:
        tab = self.table()
        return int(tab.nbytes[tab.dst == pos].sum())

    def messages(self) -> tuple[tuple[Message, ...], ...]:
        """Per step, the transfers grouped by ``(src, dst)`` (first-appearance order)."""
        out = []
        for step in self.steps:
            groups: dict[tuple[int, int], list[Transfer]] = {}
            for t in step.transfers:
                groups.setdefault((t.src, t.dst), []).append(t)
            out.append(tuple(Message(s, d, sum(t.nbytes for t in ts), tuple(ts)) for (s, d), ts in groups.items()))
        return tuple(out)

    def num_messages(self) -> int:
        tab = self.table()
        if not len(tab):
            return 0
        key = (tab.step_of() * self.p + tab.src) * self.p + tab.dst
        return int(np.unique(key).size)

    def describe(self) -> str:
        """One line for logs: kind, algorithm, group, size, steps, traffic."""
        return (f"{self.kind}[{self.algorithm}] group={self.group_shape} nbytes={self.nbytes} "
                f"steps={self.num_steps} messages={self.num_messages()} bytes_sent={self.total_bytes_sent()}")

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict:
        return {
            "format": _JSON_FORMAT, "version": _JSON_VERSION,
            "kind": self.kind, "algorithm": self.algorithm, "group_shape": list(self.group_shape),
            "nbytes": self.nbytes, "num_chunks": self.num_chunks, "itemsize": self.itemsize,
            "chunk_bytes": list(self.chunk_bytes),
            "permutation": None if self.permutation is None else [list(x) for x in self.permutation],
            "layout": list(self.layout),
            "steps": self._steps_lists(),
        }

    def _steps_lists(self) -> list:
        tab = self.table()
        rows = np.stack([tab.src, tab.dst, tab.nbytes, tab.chunk, tab.reduce, tab.count], axis=1).astype(np.int64)
        ptr = tab.ptr.tolist()
        rows = rows.tolist()
        return [rows[ptr[s]:ptr[s + 1]] for s in range(tab.num_steps)]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict, *, check: bool = True) -> CollectiveSchedule:
        if not isinstance(d, dict) or d.get("format") != _JSON_FORMAT or d.get("version") != _JSON_VERSION:
            raise CollectiveError(
                f"not a collective schedule of format {_JSON_FORMAT!r} version {_JSON_VERSION}; "
                "write it with CollectiveSchedule.to_json()")
        try:
            perm = d["permutation"]
            sched = cls(
                kind=d["kind"], algorithm=d["algorithm"], group_shape=tuple(int(x) for x in d["group_shape"]),
                nbytes=int(d["nbytes"]), num_chunks=int(d["num_chunks"]),
                steps=tuple(Step(tuple(Transfer(int(a), int(b), int(n), int(c), bool(r), int(k))
                                       for a, b, n, c, r, k in s)) for s in d["steps"]),
                layout=tuple(int(x) for x in d["layout"]),
                chunk_bytes=tuple(int(x) for x in d["chunk_bytes"]), itemsize=int(d["itemsize"]),
                permutation=None if perm is None else tuple((int(a), int(b)) for a, b in perm))
        except (KeyError, TypeError, ValueError) as e:
            raise CollectiveError(f"malformed collective schedule JSON ({e!r}); write it with to_json()") from e
        if check:
            validate_schedule(sched)
        return sched

    @classmethod
    def from_json(cls, text: str, *, check: bool = True) -> CollectiveSchedule:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise CollectiveError(f"collective schedule is not valid JSON: {e}") from e
        return cls.from_dict(d, check=check)


def validate_schedule(sched: CollectiveSchedule) -> None:
    """Check symbolically that ``sched`` computes its collective; raise CollectiveError if not.

    Tracks, for every member and chunk, the set of members whose contribution
    the held value contains (a bitmask). A reduce must add disjoint sets and
    every member must end with its output chunks complete.
    """
    p, kind = sched.p, sched.kind
    full = (1 << p) - 1
    empty = {c for c, b in enumerate(sched.chunk_bytes) if b == 0}
    state: list[dict[int, int]] = []
    for pos in range(p):
        if kind in REDUCE_KINDS:
            state.append(dict.fromkeys(range(sched.num_chunks), 1 << pos))
        else:
            state.append(dict.fromkeys(sched.input_chunks(pos), 1 << pos))
    prefix = [0]
    for nb in sched.chunk_bytes:
        prefix.append(prefix[-1] + nb)
    for si, step in enumerate(sched.steps):
        sent = []
        for t in step.transfers:
            where = f"step {si} transfer {t}"
            if not (0 <= t.src < p and 0 <= t.dst < p) or t.src == t.dst:
                raise CollectiveError(f"{where}: src/dst must be distinct positions in 0..{p - 1}")
            if t.count < 1 or not 0 <= t.chunk <= t.chunk + t.count <= sched.num_chunks:
                raise CollectiveError(f"{where}: chunks must be a non-empty run of ids < {sched.num_chunks}")
            nb = prefix[t.chunk + t.count] - prefix[t.chunk]
            if t.nbytes != nb or nb == 0:
                raise CollectiveError(f"{where}: nbytes must be the run's size {nb} and not 0")
            if t.reduce and kind not in REDUCE_KINDS:
                raise CollectiveError(f"{where}: {kind} cannot reduce")
            vals = []
            for c in t.chunks:
                if c in empty:
                    continue
                if c not in state[t.src]:
                    raise CollectiveError(f"{where}: member {t.src} does not hold chunk {c} yet")
                vals.append((c, state[t.src][c]))
            sent.append(vals)
        for t, vals in zip(step.transfers, sent):
            for c, val in vals:
                if t.reduce:
                    have = state[t.dst].get(c)
                    if have is None or have & val:
                        raise CollectiveError(
                            f"step {si} transfer {t}: reduce into chunk {c} that the destination lacks or that "
                            "would count a contribution twice")
                    state[t.dst][c] = have | val
                else:
                    state[t.dst][c] = val
    for pos in range(p):
        for c in sched.output_chunks(pos) or ():
            if c in empty:
                continue
            got = state[pos].get(c)
            if got is None or (kind in REDUCE_KINDS and got != full):
                raise CollectiveError(
                    f"{sched.kind}[{sched.algorithm}] group={sched.group_shape}: member {pos} ends without "
                    f"the complete chunk {c} (has contributions {got if got is None else bin(got)})")


def check_permutation(permutation: Sequence[Sequence[int]] | None, p: int) -> tuple[tuple[int, int], ...]:
    """Normalize and check a collective_permute ``((src, dst), ...)`` over ``p`` members
    (:func:`partir_emu.core.spmd.check_pairs`, the one check the IR also uses)."""
    return check_pairs(permutation, p)
