"""``AutomaticPartition``: search the decisions a ManualPartition on one axis would make, with a cost model.

The search space (:mod:`.auto_space`) is the one a user would write by hand: for each *family*
of inputs (names equal up to layer numbers, shapes equal), tile one dim by the tactic's axis or
leave it to propagation; optimizer state that mirrors a parameter follows it. The search
(:mod:`.auto_search`) is a Monte Carlo tree search over those decisions, largest families
first, with a budget of evaluations and seconds, a seed, caches, and a per-device memory limit.

**State semantics (composition with manual tactics).** The search starts from the state the
earlier tactics of the schedule left: what they tiled stays, a family they already tiled by this
axis is not searched, and a candidate is applied on top of that state exactly as a
ManualPartition would be (decisions are only added). Each candidate is priced *after* the manual
tactics that follow it in the schedule (``later``; an AutomaticPartition further on is not
anticipated), so e.g. ``bp + auto + z3`` prices what ZeRO-3 will make of each choice. The winner
is applied as one ManualPartition (:class:`~.auto_space.DecidedPartition`) named after the
tactic, so the state after the tactic is exactly the one the search priced, and the later tactics
then apply as written.

The compiler knows no hardware: each candidate is priced by the tactic's own ``cost``, else by
the ``cost_model`` the caller passes (a function of the tactic, so that it can read
``hardware``); a cost may return a float or a :class:`Price` (value, peak bytes, capacity and a
breakdown). :func:`partir_emu.api.analytical_cost` returns the analytical model's step time, the
peak memory against the chip's HBM, and the time per collective kind and axes, so the report can
say *why* the winner wins. The result (:class:`SearchResult`) is kept in the state's
``auto_results`` and printed by ``partir-emu show`` and ``simulate``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from partir_emu.compiler.auto.search import Candidate, Evaluator, Outcome, better, run_search
from partir_emu.compiler.auto.space import DecidedPartition, Price, Space, build_space, family, open_choices
from partir_emu.compiler.propagate import apply_tactic
from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import AutomaticPartition, CostModel, ManualPartition
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import TacticError

__all__ = ["AutomaticPartition", "DecidedPartition", "Price", "SearchResult", "apply_automatic", "cost_function",
           "family", "options", "search"]


@dataclass(frozen=True)
class SearchResult:
    decisions: dict[str, int]          # family label -> dim
    cost: float                        # the winner's value (the cost function's unit)
    baseline: float                    # value with no decision on the axis (after the earlier tactics)
    evaluations: int                   # calls of the cost function
    seconds: float = 0.0
    stopped: str = "exhausted"         # "exhausted" (every strategy priced), "budget" or "time"
    nodes: int = 0
    candidates: int = 0                # distinct strategies priced
    fits: bool = True
    memory_limit: int | None = None    # the limit applied (the tactic's, else the cost model's capacity)
    best_price: Price | None = None
    baseline_price: Price | None = None
    runner_up: dict[str, int] | None = None
    runner_up_price: Price | None = None
    tactic: ManualPartition | None = field(default=None, repr=False)

    def as_tactic(self) -> ManualPartition:
        """The winner as a ManualPartition (resolved to this program's inputs; its ``inputs`` name
        the families)."""
        if self.tactic is None:
            raise TacticError("this SearchResult carries no tactic (it was not made by auto.search)")
        return self.tactic

    def why(self, top: int = 4) -> list[str]:
        """The parts of the price that differ most between the winner and the runner-up (and the
        baseline), one line each, largest difference first."""
        lines: list[str] = []
        b = self.best_price
        for what, other, dec in (("runner-up", self.runner_up_price, self.runner_up),
                                 ("baseline", self.baseline_price, {})):
            if b is None or other is None:
                continue
            lines.append(f"vs the {what} {_decisions(dec)}: {_num(other.value)} -> {_num(b.value)}"
                         + _memory(other, b))
            keys = set(b.parts) | set(other.parts)
            diffs = sorted(keys, key=lambda k: (-abs(b.parts.get(k, 0.0) - other.parts.get(k, 0.0)), k))
            for k in diffs[:top]:
                d = b.parts.get(k, 0.0) - other.parts.get(k, 0.0)
                if d == 0:
                    break
                cnt = ""
                if k in b.counts or k in other.counts:
                    cnt = f" ({other.counts.get(k, 0)} -> {b.counts.get(k, 0)})"
                lines.append(f"  {k:<28} {_signed_s(d)}{cnt}")
        return lines

    def report(self, label: str) -> str:
        decs = "\n".join(f"  {fam} -> dim {d}" for fam, d in self.decisions.items()) or "  (none paid off)"
        ratio = f"{self.baseline / self.cost:.3g}x" if self.cost > 0 else "-"
        lim = f"; memory limit {_bytes(self.memory_limit)}" if self.memory_limit else ""
        fit = "" if self.fits else " (NO candidate fits the memory limit: the least overflow was kept)"
        if self.stopped == "time":
            fit += ("\n  (the time limit stopped the search: this result depends on the machine's speed and load and "
                    "is not reproducible; raise seconds or lower the budget)")
        head = (f"{label}: {len(self.decisions)} decision(s) after {self.evaluations} evaluations of "
                f"{self.candidates} strategies, {self.nodes} tree nodes, {self.seconds:.2f} s (stopped: "
                f"{self.stopped}{lim})")
        cost = f"  cost {_num(self.cost)} vs {_num(self.baseline)} with nothing on the axis ({ratio}){fit}"
        return "\n".join([head, decs, cost, *("  " + w for w in self.why())])

    def to_json(self) -> dict[str, Any]:
        def price(p: Price | None) -> dict | None:
            return None if p is None else {"value": p.value, "peak_bytes": p.peak_bytes, "parts": dict(p.parts),
                                           "counts": dict(p.counts)}
        return {"decisions": self.decisions, "cost": self.cost, "baseline": self.baseline,
                "evaluations": self.evaluations, "seconds": self.seconds, "stopped": self.stopped,
                "nodes": self.nodes, "candidates": self.candidates, "fits": self.fits,
                "memory_limit": self.memory_limit, "best": price(self.best_price),
                "baseline_price": price(self.baseline_price), "runner_up": self.runner_up,
                "runner_up_price": price(self.runner_up_price), "why": self.why()}


def cost_function(tactic: AutomaticPartition,
                  cost_model: CostModel | None) -> Callable[[SpmdProgram], float | Price]:
    """The tactic's own ``cost``, else ``cost_model(tactic)``; a TacticError says what to pass."""
    if tactic.cost is not None:
        return tactic.cost
    if cost_model is None:
        raise TacticError(f"{tactic.describe()}: no cost to search with; give the tactic cost=<SpmdProgram -> "
                          "float>, or pass cost_model=<AutomaticPartition -> cost function> to partition/"
                          "lower_program (partir_emu.api.lower_program and jit pass the analytical model)")
    return cost_model(tactic)


def options(state: ShardingState, tactic: AutomaticPartition) -> dict[str, list[int]]:
    """family label -> the dims its inputs could be tiled on by the tactic's axis in ``state``
    (families already tiled by the axis, or with no such dim, are left out)."""
    state.mesh.check_axis(tactic.axis)
    space = build_space(state, tactic)
    return {space.families[k].label: list(d) for k, d in open_choices(state, space, tactic.axis)}


def _check(tactic: AutomaticPartition) -> None:
    if not (isinstance(tactic.budget, int) and tactic.budget >= 1):
        raise TacticError(f"{tactic.describe()}: budget={tactic.budget!r}; give a positive number of evaluations")
    if tactic.seconds is not None and not tactic.seconds > 0:
        raise TacticError(f"{tactic.describe()}: seconds={tactic.seconds!r}; give a positive time limit, or None "
                          "(the default: the budget of evaluations alone stops the search, reproducibly)")
    if not (isinstance(tactic.rollouts, int) and tactic.rollouts >= 0):
        raise TacticError(f"{tactic.describe()}: rollouts={tactic.rollouts!r}; give 0 or more")
    if not (isinstance(tactic.polish, int) and tactic.polish >= 0):
        raise TacticError(f"{tactic.describe()}: polish={tactic.polish!r}; give 0 or more evaluations")
    if tactic.memory_limit is not None and not tactic.memory_limit > 0:
        raise TacticError(f"{tactic.describe()}: memory_limit={tactic.memory_limit!r}; give bytes per device "
                          "(> 0) or None for the cost model's capacity")


def search(state: ShardingState, tactic: AutomaticPartition, index: int, cost_model: CostModel | None = None,
           later: Sequence[ManualPartition] = (), state_outputs: dict[str, str] | None = None) -> SearchResult:
    """Search the tactic's decisions from ``state`` (see the module docstring); ``state`` is not changed.
    Candidates are lowered with ``state_outputs``, as the final lowering will be."""
    state.mesh.check_axis(tactic.axis)
    _check(tactic)
    space = build_space(state, tactic)
    ev = Evaluator(state, space, tactic, index, later, cost_function(tactic, cost_model), state_outputs)
    out = run_search(ev, tactic)
    return _result(out, space, tactic, ev)


def _result(out: Outcome, space: Space, tactic: AutomaticPartition, ev: Evaluator) -> SearchResult:
    best, base = out.best, out.baseline
    runner: Candidate | None = None
    for c in out.candidates:
        if c.fingerprint != best.fingerprint and (runner is None or better(c, runner)):
            runner = c
    assert best.price is not None and base.price is not None
    label = tactic.name or f"auto:{tactic.axis}"
    limit = ev.limit if ev.limit is not None else best.price.capacity
    return SearchResult(
        space.labels(best.decisions), best.price.value, base.price.value, out.evaluations, out.seconds, out.stopped,
        out.nodes, len(out.candidates), best.fits, limit, best.price, base.price,
        None if runner is None else space.labels(runner.decisions), None if runner is None else runner.price,
        space.tactic(best.decisions, tactic.axis, label) if best.decisions else None)


def apply_automatic(state: ShardingState, tactic: AutomaticPartition, index: int,
                    cost_model: CostModel | None = None, later: Sequence[ManualPartition] = (),
                    state_outputs: dict[str, str] | None = None, recorded: SearchResult | None = None) -> SearchResult:
    """Search, then apply the winner as one ManualPartition (recorded in ``state.auto_results``);
    with ``recorded`` (the result of this very search, replayed) apply that without searching."""
    res = recorded if recorded is not None else search(state, tactic, index, cost_model, later, state_outputs)
    label = tactic.name or f"auto:{tactic.axis}"
    if res.tactic is not None:
        apply_tactic(state, res.tactic, index)
    else:
        state.tactics_applied.append(label + " (no decision paid off)")
    state.auto_results.append((label, res))
    return res


def _decisions(dec: dict[str, int] | None) -> str:
    if not dec:
        return "(nothing on the axis)"
    return "{" + ", ".join(f"{k}: {d}" for k, d in dec.items()) + "}"


def _num(x: float) -> str:
    return f"{x:.4g}"


def _signed_s(d: float) -> str:
    a = abs(d)
    mag = f"{a * 1e3:.3f} ms" if a >= 1e-3 else f"{a * 1e6:.2f} us"
    return ("+" if d > 0 else "-") + mag


def _memory(a: Price, b: Price) -> str:
    if a.peak_bytes is None or b.peak_bytes is None:
        return ""
    return f"; peak memory {_bytes(a.peak_bytes)} -> {_bytes(b.peak_bytes)}"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} B"
