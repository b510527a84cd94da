"""``AutomaticPartition``: search the decisions a ManualPartition would make, with a cost model.

The search space is the one a user would write by hand: for each *family* of
inputs (names equal up to layer numbers, e.g. ``params/layer_*/mlp/w_in``), tile
one dim by the tactic's axis or leave it alone. Optimizer state that mirrors a
parameter (``opt/*/<path>``) follows its parameter's decision, as in ZeRO and
Megatron. Greedy coordinate descent over the families (in input order), then a
second pass; each candidate is partitioned from the state the earlier tactics
left, lowered, and priced. Deterministic: ties keep the earlier (simpler) choice.

The compiler knows no hardware: each candidate is priced by the tactic's own
``cost``, or else by the ``cost_model`` the caller passes (a function of the tactic,
so that it can read ``hardware``). The app layer (:mod:`partir_emu.api`) passes the
analytical model's step time on ``hardware`` plus a penalty when the program does not
fit in HBM, so the search trades communication against memory the way the simulator
sees it.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass

from partir_emu.compiler.lower import lower
from partir_emu.compiler.propagate import apply_tactic
from partir_emu.compiler.state import ShardingState
from partir_emu.compiler.tactics import AutomaticPartition, CostModel, ManualPartition
from partir_emu.core.ir import Var
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError, TacticError

_LAYER = re.compile(r"(?<=[_/])\d+(?=/|$)")


@dataclass(frozen=True)
class SearchResult:
    decisions: dict[str, int]          # family pattern -> dim
    cost: float
    baseline: float                    # cost with no decision
    evaluations: int

    def as_tactic(self, axis: str, name: str) -> ManualPartition:
        inputs: dict[str, int] = {}
        for fam, dim in self.decisions.items():
            inputs[fam] = dim
            if fam.startswith("params/"):
                inputs["opt/*/" + fam[len("params/"):]] = dim
        return ManualPartition(inputs, axis=axis, name=name, allow_unmatched=True)


def family(name: str) -> str:
    return _LAYER.sub("*", name)


def cost_function(tactic: AutomaticPartition, cost_model: CostModel | None) -> Callable[[SpmdProgram], float]:
    """The tactic's own ``cost``, else ``cost_model(tactic)``; a TacticError says what to pass."""
    if tactic.cost is not None:
        return tactic.cost
    if cost_model is None:
        raise TacticError(f"{tactic.describe()}: no cost to search with; give the tactic cost=<SpmdProgram -> "
                          "float>, or pass cost_model=<AutomaticPartition -> cost function> to partition/"
                          "lower_program (partir_emu.api.lower_program and jit pass the analytical model)")
    return cost_model(tactic)


def options(state: ShardingState, tactic: AutomaticPartition) -> dict[str, list[int]]:
    """family pattern -> the dims every input of the family could be tiled on by the tactic's axis
    (the axis is unused on them and the dim divides); families with no such dim are left out."""
    p, mesh = state.program, state.mesh
    n = mesh.axis_size(tactic.axis)
    pats = [tactic.inputs] if isinstance(tactic.inputs, str) else list(tactic.inputs)
    fams: dict[str, list[int]] = {}
    for i, name in enumerate(p.input_names):
        if any(fnmatch.fnmatchcase(name, q) for q in pats):
            fams.setdefault(family(name), []).append(i)
    if not fams:
        raise TacticError(f"{tactic.describe()}: pattern(s) {pats} match no input")

    def fits(v: Var, d: int, ndim: int) -> bool:
        have = state.value_dims[v]
        return v.ndim == ndim and not any(tactic.axis in x for x in have) \
            and v.shape[d] % (mesh.group_size(have[d]) * n) == 0

    out: dict[str, list[int]] = {}
    for fam, idx in fams.items():
        ndim = p.inputs[idx[0]].ndim
        dims = [d for d in range(ndim) if all(fits(p.inputs[i], d, ndim) for i in idx)]
        if dims:
            out[fam] = dims
    return out


def search(state: ShardingState, tactic: AutomaticPartition, index: int,
           cost_model: CostModel | None = None) -> SearchResult:
    """Greedy coordinate descent over the tactic's input families (see the module docstring)."""
    state.mesh.check_axis(tactic.axis)
    choices = options(state, tactic)
    cost_fn = cost_function(tactic, cost_model)
    label = tactic.name or f"auto:{tactic.axis}"
    evals = 0

    def evaluate(decisions: dict[str, int]) -> float:
        nonlocal evals
        evals += 1
        st = state.copy()
        if decisions:
            apply_tactic(st, SearchResult(decisions, 0, 0, 0).as_tactic(tactic.axis, label), index)
        try:
            return cost_fn(lower(st))
        except PartirError:
            return float("inf")

    best: dict[str, int] = {}
    baseline = best_cost = evaluate(best)
    for _ in range(tactic.passes):
        improved = False
        for fam, dims in choices.items():
            for d in dims:
                if best.get(fam) == d:
                    continue
                cand = {**best, fam: d}
                c = evaluate(cand)
                if c < best_cost * (1 - 1e-9):
                    best, best_cost, improved = cand, c, True
            if fam in best:   # also try dropping a decision taken earlier in this pass
                cand = {k: v for k, v in best.items() if k != fam}
                c = evaluate(cand)
                if c < best_cost * (1 - 1e-9):
                    best, best_cost, improved = cand, c, True
        if not improved:
            break
    return SearchResult(best, best_cost, baseline, evals)


def apply_automatic(state: ShardingState, tactic: AutomaticPartition, index: int,
                    cost_model: CostModel | None = None) -> SearchResult:
    """Search, then apply the best decisions as a ManualPartition (recorded in ``auto_results``)."""
    res = search(state, tactic, index, cost_model)
    label = tactic.name or f"auto:{tactic.axis}"
    if res.decisions:
        apply_tactic(state, res.as_tactic(tactic.axis, label), index)
    else:
        state.tactics_applied.append(label + " (no decision paid off)")
    state.auto_results.append((label, res))
    return res
