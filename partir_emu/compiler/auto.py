"""``AutomaticPartition``: search the decisions a ManualPartition would make, with a cost model.

The search space is the one a user would write by hand: for each *family* of
inputs (names equal up to layer numbers, e.g. ``params/layer_*/mlp/w_in``), tile
one dim by the tactic's axis or leave it alone. Optimizer state that mirrors a
parameter (``opt/*/<path>``) follows its parameter's decision, as in ZeRO and
Megatron. Greedy coordinate descent over the families (in input order), then a
second pass; each candidate is partitioned from the state the earlier tactics
left, lowered, and priced. Deterministic: ties keep the earlier (simpler) choice.

The default cost is the analytical model's step time on ``hardware`` plus a
penalty when the program does not fit in HBM, so the search trades
communication against memory the way the simulator sees it.
"""
from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from partir_emu.compiler.propagate import ShardingState, apply_tactic
from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PartirError, TacticError

_LAYER = re.compile(r"(?<=[_/])\d+(?=/|$)")


@dataclass(frozen=True)
class AutomaticPartition:
    axis: str
    inputs: str | Sequence[str] = "params/*"
    name: str = ""
    hardware: str = "tpu-v4"
    passes: int = 2
    cost: Callable[[SpmdProgram], float] | None = None

    def describe(self) -> str:
        return self.name or f"AutomaticPartition(axis={self.axis!r}, inputs={self.inputs!r})"


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


def default_cost(hardware: str) -> Callable[[SpmdProgram], float]:
    from partir_emu.hwmodels.analytical import simulate
    from partir_emu.hwmodels.specs import load_spec
    spec = load_spec(hardware)

    def cost(spmd: SpmdProgram) -> float:
        rep = simulate(spmd, spec)
        over = max(0, rep.peak_bytes_per_device - rep.hbm_bytes)
        return rep.step_s * (1.0 + over / max(rep.hbm_bytes, 1))
    return cost


def search(state: ShardingState, tactic: AutomaticPartition, index: int) -> SearchResult:
    from partir_emu.compiler.lower import lower
    p, mesh = state.program, state.mesh
    mesh.check_axis(tactic.axis)
    n = mesh.axis_size(tactic.axis)
    pats = [tactic.inputs] if isinstance(tactic.inputs, str) else list(tactic.inputs)
    fams: dict[str, list[int]] = {}
    for i, name in enumerate(p.input_names):
        if any(fnmatch.fnmatchcase(name, q) for q in pats):
            fams.setdefault(family(name), []).append(i)
    if not fams:
        raise TacticError(f"{tactic.describe()}: pattern(s) {pats} match no input")
    options: dict[str, list[int]] = {}
    for fam, idx in fams.items():
        v0 = p.inputs[idx[0]]
        dims = []
        for d in range(v0.ndim):
            ok = True
            for i in idx:
                v = p.inputs[i]
                have = state.value_dims[v]
                if v.ndim != v0.ndim or tactic.axis in [a for x in have for a in x] \
                        or v.shape[d] % (mesh.group_size(have[d]) * n):
                    ok = False
                    break
            if ok:
                dims.append(d)
        if dims:
            options[fam] = dims
    cost_fn = tactic.cost or default_cost(tactic.hardware)
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
        for fam, dims in options.items():
            for d in dims:
                if best.get(fam) == d:
                    continue
                cand = dict(best)
                cand[fam] = d
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


def apply_automatic(state: ShardingState, tactic: AutomaticPartition, index: int) -> SearchResult:
    res = search(state, tactic, index)
    label = tactic.name or f"auto:{tactic.axis}"
    if res.decisions:
        apply_tactic(state, res.as_tactic(tactic.axis, label), index)
    else:
        state.tactics_applied.append(label + " (no decision paid off)")
    state.auto_results.append((label, res))
    return res
