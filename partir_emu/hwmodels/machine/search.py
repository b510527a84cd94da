"""Placement search: try the legal maps of mesh axes to physical dims and keep the cheapest.

:func:`enumerate_placements` lists the placements of a mesh on a topology: each physical dim is
split, major→minor, among the mesh axes (an axis takes a whole dim or a factor of it, as the
default fill does), and each axis takes the product of its parts. On a TPU torus that covers
``"model=x,batch=yz"`` forms and factorised ones like ``"batch=x+y+z[4],model=z[4]"``; on a GPU
cluster (dims ``node``, ``gpu``) an axis inside a node, across nodes, or both. Placements that a
symmetry of the topology (permuting physical dims of equal size and wraparound) maps onto each
other are priced once; the default fill always comes first, then the placements that split fewest
dims (ties: by their mapping text), up to ``limit``.

:func:`search_placement` prices each with the analytical model (``Analyzer.step``) and keeps
the cheapest; ties go to the default fill, then to the lexicographically first mapping. Its
:class:`PlacementChoice` carries the runner-up, every candidate's step, the search time, and the
warnings of the chosen placement with their price (:func:`priced_warnings`).

Two things make a search cheaper without changing what it chooses:

- the steps found are kept in the Analyzer by everything they depend on
  (:meth:`~partir_emu.hwmodels.analytical.Analyzer.step_key`: the program, its compute times on the
  chip, the stack, the topology's links, the options), so a spec that differs only in what no step
  reads (a what-if of the HBM capacity) takes them without pricing;
- ``prune=True`` (a study, which wants the best only) skips a placement once a lower bound of its
  step (:mod:`partir_emu.hwmodels.bounds`, from the prices of some of its collectives) is above the
  best step found so far (beyond the tie margin, so the best and its ties are always priced): the
  chosen placement and its step are the same, but ``candidates`` holds only the placements priced
  to the end (the runner-up is the best of those). Raising a bound, a collective's floor
  (:meth:`~partir_emu.hwmodels.network.comm.CommModel.floor`: one lock-step pass over its steps, the
  first part of its price) is tried before its price: what the floor pushes past the best step the
  price would too.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from partir_emu.core.mesh import Mesh
from partir_emu.core.spmd import SpmdProgram
from partir_emu.errors import PlacementError
from partir_emu.hwmodels.analytical import Analyzer
from partir_emu.hwmodels.bounds import Probe
from partir_emu.hwmodels.machine.mapping import Factor
from partir_emu.hwmodels.machine.placement import Placement
from partir_emu.hwmodels.machine.specs import HardwareSpec
from partir_emu.hwmodels.machine.topology import Topology

__all__ = ["PlacementChoice", "enumerate_placements", "priced_warnings", "resolve_placement", "search_placement"]

MAX_ENUMERATED = 20000       # raw assignments looked at before deduplication (a 3-axis mesh on 16x16x16 has ~10^4)
TIE_REL = 1e-9               # steps this close count as equal (then the default fill, then the text, wins)


@dataclass(frozen=True)
class PlacementChoice:
    """The result of :func:`search_placement`. ``candidates``: (mapping, step_s) of every placement
    priced, cheapest first; ``warnings``: one line each, about ``best``, priced."""

    best: Placement
    mapping: str
    step_s: float
    runner_up: Placement | None
    runner_up_mapping: str | None
    runner_up_step_s: float | None
    default_mapping: str | None
    default_step_s: float | None
    candidates: tuple[tuple[str, float], ...]
    warnings: tuple[str, ...]
    search_s: float
    enumerated: int = 0                       # assignments enumerated before dedup and the limit
    default_warnings: tuple[str, ...] = ()    # the default fill's, priced, when the search chose another
    steps: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def lines(self) -> list[str]:
        """What ``simulate`` prints: the chosen placement, the runner-up, the default fill, the search."""
        out = [f"placement: {self.mapping}  step {self.step_s * 1e3:.4f} ms  (cheapest of {len(self.candidates)})"]
        if self.runner_up_mapping is not None and self.runner_up_step_s is not None:
            out.append(f"runner-up: {self.runner_up_mapping}  step {self.runner_up_step_s * 1e3:.4f} ms  "
                       f"({_ratio(self.runner_up_step_s, self.step_s)})")
        if self.default_mapping is not None and self.default_step_s is not None and self.default_mapping not in (
                self.mapping, self.runner_up_mapping):
            out.append(f"default fill: {self.default_mapping}  step {self.default_step_s * 1e3:.4f} ms  "
                       f"({_ratio(self.default_step_s, self.step_s)})")
        out.append(f"searched {len(self.candidates)} placements ({self.enumerated} enumerated) in "
                   f"{self.search_s * 1e3:.1f} ms")
        return out

    def to_json(self) -> dict:
        return {"mapping": self.mapping, "step_s": self.step_s, "placement": self.best.describe(),
                "runner_up": self.runner_up_mapping, "runner_up_step_s": self.runner_up_step_s,
                "default_mapping": self.default_mapping, "default_step_s": self.default_step_s,
                "candidates": [list(c) for c in self.candidates], "warnings": list(self.warnings),
                "default_warnings": list(self.default_warnings),
                "search_s": self.search_s, "enumerated": self.enumerated}


def _ratio(step: float, best: float) -> str:
    return f"{step / best:.2f}x the best" if best > 0 else "n/a"


# -- enumeration --------------------------------------------------------------------------------------
def _divisors(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def _splits(n: int, remaining: dict[str, int], used: frozenset[str] = frozenset()
            ) -> Iterator[tuple[tuple[str, int], ...]]:
    """Ordered splits (major→minor) of a physical dim of ``n`` positions among distinct mesh axes,
    each part dividing what that axis still needs."""
    if n == 1:
        yield ()
        return
    for axis, left in remaining.items():
        if axis in used or left == 1:
            continue
        for s in _divisors(math.gcd(n, left)):
            for rest in _splits(n // s, remaining, used | {axis}):
                yield ((axis, s),) + rest


def _assignments(mesh: Mesh, topo: Topology) -> Iterator[dict[int, tuple[tuple[str, int], ...]]]:
    """Every split of every physical dim such that each mesh axis gets exactly its size."""
    dims = [d for d, s in enumerate(topo.dims) if s > 1]

    def rec(i: int, remaining: dict[str, int], acc: dict[int, tuple[tuple[str, int], ...]]
            ) -> Iterator[dict[int, tuple[tuple[str, int], ...]]]:
        if i == len(dims):
            if all(v == 1 for v in remaining.values()):
                yield dict(acc)
            return
        d = dims[i]
        for split in _splits(topo.dims[d], remaining):
            left = dict(remaining)
            for a, s in split:
                left[a] //= s
            acc[d] = split
            yield from rec(i + 1, left, acc)
        acc.pop(d, None)

    yield from rec(0, {a: s for a, s in mesh.axes if s > 1}, {})


def _factors(assign: dict[int, tuple[tuple[str, int], ...]], mesh: Mesh) -> dict[str, tuple[Factor, ...]]:
    out: dict[str, list[Factor]] = {a: [] for a in mesh.axis_names}
    for d in sorted(assign):
        stride = 1
        for a, s in reversed(assign[d]):
            out[a].append(Factor(d, s, stride))
            stride *= s
    return {a: tuple(sorted(fs, key=lambda f: f.dim)) for a, fs in out.items()}


def _symmetries(topo: Topology) -> list[tuple[int, ...]]:
    """Permutations of the physical dims that map the topology onto itself (equal size and wraparound)."""
    n = len(topo.dims)
    if topo.kind != "torus":
        return [tuple(range(n))]
    return [p for p in itertools.permutations(range(n))
            if all(topo.dims[p[d]] == topo.dims[d] and topo.wrap[p[d]] == topo.wrap[d] for d in range(n))]


def _signature(p: Placement, perms: list[tuple[int, ...]]) -> tuple:
    return min(tuple(tuple(sorted((perm[f.dim], f.size, f.stride) for f in p.factors[a] if f.size > 1))
                     for a in p.mesh.axis_names) for perm in perms)


def _default(mesh: Mesh, topo: Topology) -> Placement | None:
    try:
        return Placement(mesh, topo)
    except PlacementError:               # axis sizes that do not tile the dims in order: no default fill
        return None


def enumerate_placements(mesh: Mesh, topology: Topology, limit: int = 64) -> tuple[list[Placement], int]:
    """The placements to price (default fill first, symmetric equivalents dropped, at most ``limit``)
    and how many assignments were enumerated. Raises :class:`PlacementError` if there is none."""
    perms = _symmetries(topology)
    seen: set[tuple] = set()
    default = _default(mesh, topology)
    out: list[tuple[tuple, Placement]] = []
    if default is not None and default.mapping_text() is not None:
        seen.add(_signature(default, perms))
    count = 0
    for assign in _assignments(mesh, topology):
        count += 1
        if count > MAX_ENUMERATED:
            break
        p = Placement.from_factors(mesh, topology, _factors(assign, mesh))
        sig = _signature(p, perms)
        if sig in seen or p.mapping is None:           # a symmetric twin, or no text the CLI could take back
            continue
        seen.add(sig)
        splits = sum(1 for fs in p.factors.values() for f in fs if 1 < f.size < topology.dims[f.dim])
        out.append(((splits, p.mapping), p))
    out.sort(key=lambda t: t[0])
    found = ([default] if default is not None and default.mapping_text() is not None else []) + [p for _, p in out]
    if not found:
        raise PlacementError(f"no placement of {mesh} on {topology.describe()}: the mesh axis sizes do not "
                             f"factor into its dims; choose axis sizes that divide the physical dims")
    return found[:max(1, limit)], count


# -- search -------------------------------------------------------------------------------------------
def search_placement(spmd: SpmdProgram, spec: HardwareSpec | str, analyzer: Analyzer | None = None, overlap: bool = False,
                     slice_dims: Sequence[int] | None = None, *, limit: int = 64, prune: bool = False,
                     **simulate_kwargs) -> PlacementChoice:
    """Price every placement of :func:`enumerate_placements` with ``Analyzer.step`` (``overlap`` and
    ``simulate_kwargs`` passed on: ``algorithms``, ``prefetch_bytes``, fault options...) and keep the
    cheapest. ``analyzer``: an :class:`~partir_emu.hwmodels.analytical.Analyzer` (default: a new one).
    ``prune``: skip the placements that surely cannot win (module docstring)."""
    t0 = time.perf_counter()
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(spec)
    topo = analyzer.topology(spec, spmd.mesh.size, slice_dims)
    places, count = enumerate_placements(spmd.mesh, topo, limit)
    default_text = places[0].mapping_text() if places[0].mapping is None else None
    key = analyzer.step_key(spmd, spec, overlap, slice_dims, limit=limit, **simulate_kwargs)
    hit = analyzer.searches.get(key) if key is not None else None
    if hit is not None and hit[0] is spmd.program and (prune or hit[2]):
        steps = hit[1]
    else:
        steps = _steps(spmd, spec, analyzer, places, overlap, prune, simulate_kwargs)
        if key is not None:
            analyzer.remember_search(key, (spmd.program, steps, len(steps) == len(places)))
    priced: list[tuple[float, int, str, Placement]] = []
    for i, p in enumerate(places):
        if i in steps:
            text = p.mapping_text() or p.describe()
            priced.append((steps[i], 0 if text == default_text else 1, text, p))
    order = _rank(priced)
    best, runner = order[0], (order[1] if len(order) > 1 else None)
    steps = {t: s for s, _, t, _ in priced}
    choice = PlacementChoice(
        best=best[3], mapping=best[2], step_s=best[0],
        runner_up=runner[3] if runner else None, runner_up_mapping=runner[2] if runner else None,
        runner_up_step_s=runner[0] if runner else None,
        default_mapping=default_text, default_step_s=steps.get(default_text) if default_text else None,
        candidates=tuple((t, s) for s, _, t, _ in order), warnings=(), search_s=0.0, enumerated=count, steps=steps)
    warnings = tuple(priced_warnings(best[3], best[0], choice))
    dflt = next((t for t in priced if t[1] == 0), None)
    dflt_warnings = tuple(priced_warnings(dflt[3], dflt[0], choice)) if dflt is not None and dflt is not best else ()
    return _replace(choice, warnings=warnings, default_warnings=dflt_warnings, search_s=time.perf_counter() - t0)


def _steps(spmd: SpmdProgram, spec: HardwareSpec, analyzer: Analyzer, places: list[Placement], overlap: bool,
           prune: bool, kw: dict) -> dict[int, float]:
    """The step of each placement priced, by its index in ``places``. With ``prune`` those that surely
    cannot win are left out: every placement's bound is raised by its most telling collective
    (:mod:`partir_emu.hwmodels.bounds`, the chain fitted to byte-count estimates), the lowest is priced
    in full (and the chain fitted again to its prices), then each other one, lowest bound first, is
    priced in full unless its bound, raised one collective at a time, passes the best step so far."""
    def step(i: int) -> float:
        return float(analyzer.step(spmd, spec, placement=places[i], overlap=overlap, **kw))

    bound = analyzer.step_bound(spmd, spec, overlap, **kw) if prune and len(places) > 1 else None
    if bound is None:
        return {i: step(i) for i in range(len(places))}
    keys = analyzer.wire_keys(spmd.program, spec)

    def probe(p: Placement) -> Probe:
        model = analyzer.comm_model(spmd, p, **kw)
        return Probe(bound, lambda k: model.cost(*keys[k]).time_s, lambda k: model.floor(*keys[k]))

    fastest = max((lk.bw_bytes_per_s for lk in places[0].topology.links), default=1.0)
    bound.fit(np.array([nbytes / fastest for _, _, nbytes, _, _ in keys], dtype=np.float64))
    probes = {i: probe(p) for i, p in enumerate(places)}
    for pr in probes.values():
        pr.advance(1)
    steps: dict[int, float] = {}
    best = math.inf
    for i in sorted(probes, key=lambda i: (probes[i].value, i)):
        if steps and probes[i].exceeds(best * (1 + 2 * TIE_REL)):   # beyond the tie margin: the choice stands
            continue
        steps[i] = step(i)
        best = min(best, steps[i])
        if len(steps) == 1:                                  # its prices are known now: a better chain
            bound.fit(np.array([probes[i].price(k) for k in range(len(keys))], dtype=np.float64))
    return steps


def _rank(priced: list[tuple[float, int, str, Placement]]) -> list[tuple[float, int, str, Placement]]:
    """Cheapest first; steps within TIE_REL of each other are ordered default fill first, then by text."""
    by_step = sorted(priced, key=lambda t: (t[0], t[1], t[2]))
    out: list[tuple[float, int, str, Placement]] = []
    i = 0
    while i < len(by_step):
        j = i + 1
        while j < len(by_step) and by_step[j][0] <= by_step[i][0] * (1 + TIE_REL):
            j += 1
        out += sorted(by_step[i:j], key=lambda t: (t[1], t[2]))
        i = j
    return out


def _replace(choice: PlacementChoice, **kw) -> PlacementChoice:
    return dataclasses.replace(choice, **kw)


def priced_warnings(placement: Placement, step_s: float, choice: PlacementChoice) -> list[str]:
    """The structural warnings of ``placement`` (:meth:`Placement.warnings`), each with what the
    placement costs against the best one ``choice`` found (one line each)."""
    out = []
    for w in placement.warnings():
        if choice.step_s > 0 and step_s > choice.step_s * (1 + TIE_REL):
            cost = f"this placement costs {step_s / choice.step_s:.2f}x the best one ({choice.mapping})"
        else:
            cost = f"still the cheapest of the {len(choice.candidates)} placements tried"
        out.append(f"{w.text}; {cost}")
    return out


def resolve_placement(spmd: SpmdProgram, spec: HardwareSpec | str, text: str | Mapping | None,
                      analyzer: Analyzer | None = None,
                      overlap: bool = False, slice_dims: Sequence[int] | None = None, *, prune: bool = False,
                      **simulate_kwargs) -> tuple[Placement, PlacementChoice | None, list[str]]:
    """What the CLI uses: ``"auto"`` (or ``None``) searches; ``"default"`` or an explicit mapping is placed
    as given. Returns (placement, the search if one ran, priced warnings of the placement). An
    explicit or default placement is searched only when it has warnings, to price them. ``prune``:
    as :func:`search_placement`'s."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        choice = search_placement(spmd, spec, analyzer, overlap, slice_dims, prune=prune, **simulate_kwargs)
        return choice.best, choice, list(choice.warnings)
    analyzer = analyzer if analyzer is not None else Analyzer()
    spec = analyzer.spec(spec)
    placement = analyzer.placement(spmd.mesh, spec, text, slice_dims)
    if not placement.warnings():
        return placement, None, []
    choice = search_placement(spmd, spec, analyzer, overlap, placement.topology.dims, prune=prune, **simulate_kwargs)
    own = analyzer.simulate(spmd, spec, placement=placement, overlap=overlap, **simulate_kwargs).step_s
    return placement, choice, priced_warnings(placement, float(own), choice)
