"""The configurations of a study: a grid over hardware, chip counts, strategies, mesh shapes,
``--set`` values and what-if edits, or a random sample of it (``--budget N``).

* ``--mesh auto`` enumerates every factorisation of each chip count over the strategy's axes: a
  strategy with a data part (``bp``, ``z2``, ``z3``) and a model part (``mp``, ``sp``, ``emb``)
  gets ``batch=N/m,model=m`` for every divisor ``1 < m < N``; one with only data parts
  ``batch=N``, only model parts ``model=N``. A shape the model cannot take (heads not divisible by
  the model axis, say) is reported by the study as a configuration that does not lower, not dropped.
* ``--set microbatches=1,4,seq=2048`` is a grid: a token without ``=`` is one more value of the key
  before it (``microbatches`` takes 1 and 4, ``seq`` 2048).
* ``--strategy all``: the scenario's named strategies, the automatic ones (``auto``, a search of its
  own) left out; or a comma-separated list.
"""
from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from partir_emu.app.study.whatif import WhatIf
from partir_emu.core.mesh import Mesh
from partir_emu.errors import UsageError
from scenarios import get_scenario
from scenarios.common import MODEL_AXIS

DATA_PARTS, MODEL_PARTS = ("bp", "z2", "z3"), ("mp", "sp", "emb")


@dataclass(frozen=True)
class Config:
    """One point of the study: what is lowered (scenario .. overrides) and what it is priced on."""

    scenario: str
    size: str | None
    overrides: str | None           # "batch=64,microbatches=4": the --set of this point
    strategy: str
    mesh: Mesh
    hardware: str
    what_if: WhatIf

    @property
    def lowering_key(self) -> tuple:
        return (self.scenario, self.size, self.overrides, self.strategy, self.mesh)

    @staticmethod
    def from_json(d: dict) -> Config:
        """The inverse of :meth:`to_json` (how a configuration reaches a worker process)."""
        return Config(d["scenario"], d["size"], d["set"], d["strategy"], Mesh.parse(d["mesh"]), d["hardware"],
                      WhatIf.parse(d["what_if"]) if d["what_if"] != WhatIf().label else WhatIf())

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "size": self.size, "set": self.overrides, "strategy": self.strategy,
                "mesh": ",".join(f"{a}={n}" for a, n in self.mesh.axes), "chips": self.mesh.size,
                "hardware": self.hardware, "what_if": self.what_if.label}


def split_list(text: str, flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"{flag} {text!r}: give one or more values joined by ','")
    return items


def parse_chips(text: str) -> list[int]:
    out = []
    for t in split_list(text, "--chips"):
        if not t.isdigit() or int(t) < 1:
            raise UsageError(f"--chips {t!r}: a chip count is a positive integer (e.g. --chips 256,512)")
        out.append(int(t))
    return out


def parse_set_grid(text: str | None) -> list[str | None]:
    """``"microbatches=1,4,seq=2048"`` -> ``["microbatches=1,seq=2048", "microbatches=4,seq=2048"]``."""
    if not text:
        return [None]
    keys: list[tuple[str, list[str]]] = []
    for tok in (t.strip() for t in text.split(",")):
        if not tok:
            continue
        if "=" in tok:
            k, _, v = tok.partition("=")
            if not k.strip() or not v.strip():
                raise UsageError(f"--set {text!r}: {tok!r} is not KEY=VALUE")
            keys.append((k.strip(), [v.strip()]))
        elif keys:
            keys[-1][1].append(tok)
        else:
            raise UsageError(f"--set {text!r}: starts with {tok!r}, a value without its KEY=")
    return [",".join(f"{k}={v}" for (k, _), v in zip(keys, combo))
            for combo in itertools.product(*(vals for _, vals in keys))]


def strategies(scenario: str, text: str) -> list[str]:
    sc = get_scenario(scenario)
    if text == "all":
        return sorted(s for s in sc.strategies if "auto" not in s.split("+"))
    return split_list(text, "--strategy")


def meshes(strategy: str, chips: int) -> list[Mesh]:
    """Every factorisation of ``chips`` over ``strategy``'s axes (module docstring)."""
    parts = {p.partition("@")[0] for p in strategy.split("+")}
    data, model = bool(parts & set(DATA_PARTS)), bool(parts & set(MODEL_PARTS))
    if data and model:
        return [Mesh((('batch', chips // m), (MODEL_AXIS, m))) for m in range(2, chips) if chips % m == 0]
    if model:
        return [Mesh(((MODEL_AXIS, chips),))]
    return [Mesh(batch=chips)]


def grid(scenario: str, size: str | None, set_text: str | None, strategy_text: str, mesh_text: str,
         chips: Sequence[int] | None, hardware: Sequence[str], what_ifs: Sequence[WhatIf]) -> list[Config]:
    """Every configuration of the study, in a fixed order."""
    strats = strategies(scenario, strategy_text)
    if mesh_text == "auto":
        if not chips:
            raise UsageError("--mesh auto enumerates the meshes of each chip count: give --chips, e.g. "
                             "--chips 256,512")
        mesh_of = {s: [m for n in chips for m in meshes(s, n)] for s in strats}
    else:
        fixed = [Mesh.parse(t) for t in mesh_text.split(";") if t.strip()]
        if chips and any(m.size not in chips for m in fixed):
            raise UsageError(f"--mesh {mesh_text!r} has {[m.size for m in fixed]} devices, not among --chips "
                             f"{list(chips)}; leave --chips out or write --mesh auto")
        mesh_of = {s: fixed for s in strats}
    wis = [WhatIf(), *what_ifs]
    return [Config(scenario, size, o, s, m, hw, w) for o in parse_set_grid(set_text) for s in strats
            for m in mesh_of[s] for hw in hardware for w in wis]


def sample(configs: Sequence[Config], budget: int | None, seed: int = 0) -> list[Config]:
    """``budget`` configurations drawn at random without replacement (``seed``), in grid order; all
    of them when the grid is no larger."""
    if budget is None or budget >= len(configs):
        return list(configs)
    keep = sorted(random.Random(seed).sample(range(len(configs)), budget))
    return [configs[i] for i in keep]


__all__ = ["Config", "grid", "meshes", "parse_chips", "parse_set_grid", "sample", "split_list", "strategies"]
