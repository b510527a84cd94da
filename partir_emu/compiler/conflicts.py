"""Sharding conflicts met by propagation, and the warnings they turn into.

Propagation never guesses: where two sources disagree about an axis at an equation, the
equation is left as it is, a :class:`Conflict` is recorded and the lowering reshards there.
Most conflicts are intended. Every ZeRO schedule makes some: the parameters are tiled by the
data axis *after* the batch tactic tiled the activations by it, so the earlier tactic wins and
each parameter is all-gathered where it meets an activation.

A conflict between two decisions of *the same tactic* is different. Both sides got the axis from
that tactic, so which one won was decided by the order in which propagation happened to reach
them, not by the user. Writing BP and ZeRO-3 as one ``ManualPartition`` (batch inputs and
parameters on the same axis) does this: a parameter's tiling reaches the activations before the
batch's does, activations end up with ``d_model`` tiled by the batch axis, and the gradients are
all-reduced instead of reduce-scattered. Such conflicts are flagged ``within_tactic`` and reported
by :func:`warnings`, one line per (tactic, kind), with the count and the first example, unless the
tactic says its seeds are meant to meet (``ManualPartition(meet="reshard")``, e.g. multi-query
sharding: the KV cache on batch, the queries on heads, resharded where they meet).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partir_emu.core.ir import Program, Var

# kind -> what it means, for a warning line
KINDS = {
    "disagree": "two of its values want different factors of one equation tiled",
    "other-factor": "a value wants another factor tiled than the one the equation took",
    "two-dims": "a value would need the axis on a second dim",
    "order": "a value's dim would need the axes in another order",
    "producer": "a value's producer cannot compute the tiling its consumer wants",
    "pinned": "a value pinned REPLICATED is asked to take the axis",
    "not-block": "a tiling is not a block layout at an equation",
    "loop-dim": "a loop's stacked operand (e.g. per-layer weights of a scan) is tiled on its iteration dim, which "
                "a loop runs on every device: it is gathered whole before the loop",
}
# what to do, where the general advice (split the tactic) does not apply
ADVICE = {
    "loop-dim": "tile another dim of the stacked operand (dim 1 or later: each iteration's slice is then tiled)",
}
# what to do where the conflict sits at an equation that cuts a dim into pieces or joins pieces into one
# (a fused projection: q|k|v in one weight, split after the matmul; its gradient is their concatenation)
PIECES = frozenset({"concatenate", "split", "slice"})
PIECES_ADVICE = ("the equation cuts a dim into pieces or joins them (e.g. a fused q|k|v projection split into "
                 "q, k and v, whose gradient concatenates them): a tiling of the fused dim gives each device "
                 "parts of some pieces, not a tile of each, so it cannot carry over without resharding; splitting "
                 "the tactic would not change that. Tile each piece's own dim instead (separate weights, or the "
                 "fused weight reshaped so that heads are a dim of their own), or accept the all-gather here")


@dataclass(frozen=True)
class Conflict:
    """Two sources disagree about ``axis`` at equation ``eqn``; ``message`` names both origins.

    ``kind`` is a key of :data:`KINDS`; ``value``/``dim`` the value (and dim) that could not take
    the axis as wanted, if one did; ``tactic`` the label of the tactic whose propagation met it;
    ``within_tactic``: both sides got the axis from that tactic (see the module docstring);
    ``intended``: that tactic said its seeds are meant to meet (``ManualPartition(meet="reshard")``),
    so the conflict is resharded without a warning."""

    axis: str
    eqn: int
    message: str
    kind: str = "disagree"
    value: Var | None = None
    dim: int | None = None
    tactic: str = ""
    within_tactic: bool = False
    intended: bool = False


def warnings(conflicts: Sequence[Conflict], program: Program, origin_of: dict[tuple[int, str], str]) -> list[str]:
    """One line per (tactic, kind) of within-tactic conflict: the count and the first example
    (value, dim, axis and where), and what to do. ``origin_of`` is the state's (var id, axis) ->
    why map, used to name where the example value's tiling came from."""
    names = dict(zip(program.inputs, program.input_names))
    groups: dict[tuple[str, str], list[Conflict]] = {}
    for c in conflicts:
        if c.within_tactic and not c.intended:
            groups.setdefault((c.tactic, c.kind), []).append(c)
    lines = []
    for (tactic, kind), cs in groups.items():
        c = cs[0]
        e = program.eqns[c.eqn]
        what = ""
        if c.value is not None:
            what = f"{c.value}:{c.value.type_str()}" + (f" {names[c.value]!r}" if c.value in names else "")
            what += f" dim {c.dim}" if c.dim is not None else ""
            why = origin_of.get((c.value.id, c.axis))
            what += (f" (tiled by {why})" if why else "") + " "
        lines.append(
            f"tactic {tactic!r} on axis {c.axis!r}: {len(cs)} conflict(s) between its own decisions "
            f"[{kind}]: {KINDS.get(kind, kind)}, e.g. {what}at [{c.eqn}] {e.prim} {e.source or '?'}; "
            + (PIECES_ADVICE if e.prim in PIECES and kind not in ADVICE else
               ADVICE.get(kind, "propagation order picked the winner, so a dim may be tiled that was not meant to "
                                "be: split the tactic, one per intent (e.g. batch inputs first, then parameters)")))
    return lines
