"""Claims in a TOML file, for users without pytest (``partir-emu check claims.toml``).

The file names configurations (``[config.NAME]``: :func:`partir_emu.testing.predict`'s arguments)
and states claims about them (``[[claim]]``), each of exactly one kind::

    [config.mp]
    scenario = "transformer"
    strategy = "bp+mp+z3"
    mesh = "batch=16,model=4"          # or { batch = 16, model = 4 }
    hardware = "tpu-v4"                # the default
    size = "small"
    set = { batch = 64 }               # or "batch=64"

    [[claim]]
    name = "Megatron + ZeRO-3 beats ZeRO-3 by 10 %"      # optional: a name is made from the claim
    faster = ["mp", "z3"]
    by = 0.10

Kinds (the assertion of :mod:`.assertions` each one runs): ``faster = [A, B]`` (``by``),
``fits = A`` (``hbm``), ``within = A`` (``measured_s``, ``rel``), ``collectives = A``
(``expect``, ``only``), ``baseline = A`` (``file``, default ``baselines/<name>.json`` beside the
claims file; ``tolerances``) and ``verified = A`` (the scenario run in process on its emulated mesh
and verified against ``jax.jit``: emulation sizes only).

The whole file is checked before anything is priced: an unknown key, kind or configuration, a
missing argument or a value of the wrong type is a :class:`~partir_emu.errors.UsageError` naming
the file, the claim and the key. A claim that cannot be evaluated (its configuration does not
lower, say) is an *error* of that claim; a claim that does not hold is a *failure*
(:class:`~.assertions.ClaimFailed`). Each configuration is priced once however many claims use it.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from partir_emu.app.claims import assertions as a
from partir_emu.app.claims import predict as model_predict
from partir_emu.app.claims.assertions import ClaimFailed
from partir_emu.app.claims.baselines import Baselines
from partir_emu.app.claims.prediction import as_mesh, as_overrides
from partir_emu.app.experiment import Experiment, run_local
from partir_emu.errors import PartirError, UsageError
from partir_emu.limits import load_toml

CONFIG_KEYS = {"scenario": str, "strategy": str, "mesh": (str, dict), "hardware": str, "size": str,
               "set": (str, dict), "stack": str, "placement": str, "overlap": bool}
KINDS: dict[str, dict[str, Any]] = {        # kind -> its other keys and their types
    "faster": {"by": (int, float)},
    "fits": {"hbm": (int, float, str)},
    "within": {"measured_s": (int, float), "rel": (int, float)},
    "collectives": {"expect": dict, "only": bool},
    "baseline": {"file": str, "tolerances": dict},
    "verified": {},
}
UPDATE_HOW = "partir-emu check --update-baselines"
REQUIRED = {"within": ("measured_s",), "collectives": ("expect",)}


@dataclass(frozen=True)
class Claim:
    name: str
    kind: str
    configs: tuple[str, ...]
    args: dict[str, Any]


@dataclass
class Outcome:
    claim: Claim
    status: str                     # "pass", "fail" or "error"
    message: str = ""
    seconds: float = 0.0


@dataclass
class ClaimsFile:
    path: Path
    configs: dict[str, dict[str, Any]]
    claims: list[Claim] = field(default_factory=list)


def _types(v: Any, t: Any) -> bool:
    return isinstance(v, t) and not (isinstance(v, bool) and t in ((int, float), (int, float, str)))


def _config(path: Path, name: str, table: Any) -> dict[str, Any]:
    where = f"{path}: [config.{name}]"
    if not isinstance(table, dict):
        raise UsageError(f"{where} is not a table; write [config.{name}] with scenario=, strategy=, mesh=")
    for k, v in table.items():
        if k not in CONFIG_KEYS:
            raise UsageError(f"{where}: unknown key {k!r}; a configuration takes {', '.join(CONFIG_KEYS)}")
        if not _types(v, CONFIG_KEYS[k]):
            raise UsageError(f"{where}: {k} = {v!r} has the wrong type (expected {CONFIG_KEYS[k]})")
    for k in ("scenario", "strategy", "mesh"):
        if k not in table:
            raise UsageError(f"{where}: no {k} (a configuration needs scenario, strategy and mesh)")
    return dict(table)


def _claim(path: Path, i: int, table: Any, configs: Mapping[str, Any]) -> Claim:
    where = f"{path}: claim {i + 1}"
    if not isinstance(table, dict):
        raise UsageError(f"{where} is not a table; write [[claim]] entries")
    kinds = [k for k in table if k in KINDS]
    if len(kinds) != 1:
        raise UsageError(f"{where}: {'names ' + ' and '.join(kinds) if kinds else 'has no kind'}; a claim is "
                         f"exactly one of {', '.join(KINDS)} (e.g. fits = \"mp\")")
    kind = kinds[0]
    subject = table[kind]
    names = tuple(subject) if kind == "faster" and isinstance(subject, list) else (subject,)
    if kind == "faster" and (len(names) != 2 or not isinstance(subject, list)):
        raise UsageError(f"{where}: faster = {subject!r}: name two configurations, faster = [\"a\", \"b\"] "
                         f"(a's step is shorter than b's)")
    for n in names:
        if not isinstance(n, str) or n not in configs:
            raise UsageError(f"{where}: {kind} names {n!r}, not a configuration of the file "
                             f"({', '.join(sorted(configs)) or 'none: add [config.NAME] tables'})")
    args = {k: v for k, v in table.items() if k not in (kind, "name")}
    for k, v in args.items():
        allowed = KINDS[kind]
        if k not in allowed:
            raise UsageError(f"{where}: {k!r} is not a key of a {kind} claim "
                             f"(it takes {', '.join(['name', *allowed]) })")
        if not _types(v, allowed[k]):
            raise UsageError(f"{where}: {k} = {v!r} has the wrong type for a {kind} claim")
    for k in REQUIRED.get(kind, ()):
        if k not in args:
            raise UsageError(f"{where}: a {kind} claim needs {k}")
    name = table.get("name") or f"{kind} {' vs '.join(names)}"
    if not isinstance(name, str):
        raise UsageError(f"{where}: name = {name!r} is not text")
    return Claim(name, kind, names, args)


def load_claims(path: str | os.PathLike) -> ClaimsFile:
    """Read and check the whole claims file (module docstring); nothing is priced yet."""
    p = Path(path)
    data = load_toml(p, UsageError, "claims file")
    unknown = set(data) - {"config", "claim"}
    if unknown:
        raise UsageError(f"{p}: unknown table(s) {sorted(unknown)}; a claims file has [config.NAME] and [[claim]]")
    raw_configs = data.get("config", {})
    if not isinstance(raw_configs, dict):
        raise UsageError(f"{p}: config must be tables [config.NAME]")
    configs = {n: _config(p, n, t) for n, t in raw_configs.items()}
    raw_claims = data.get("claim", [])
    if not isinstance(raw_claims, list) or not raw_claims:
        raise UsageError(f"{p}: no [[claim]] entries: nothing to check")
    claims = [_claim(p, i, t, configs) for i, t in enumerate(raw_claims)]
    seen: dict[str, int] = {}
    for i, c in enumerate(claims):
        if c.name in seen:
            raise UsageError(f"{p}: claims {seen[c.name] + 1} and {i + 1} are both named {c.name!r}; name each "
                             f"claim once (name = \"...\")")
        seen[c.name] = i
    cf = ClaimsFile(p, configs, claims)
    for c in claims:
        if c.kind == "baseline":
            baseline_path(cf, c)             # a wrong path is the file's mistake: named before pricing
    return cf


def baseline_path(cf: ClaimsFile, claim: Claim) -> Path:
    """Where a baseline claim's snapshot lives: its ``file`` (relative to the claims file) or
    ``baselines/<claim name>.json`` beside it; never the claims file itself."""
    stem = re.sub(r"[^A-Za-z0-9_.+=-]+", "_", claim.name).strip("_") or "claim"
    p = cf.path.parent / claim.args.get("file", f"baselines/{stem}.json")
    if p.resolve() == cf.path.resolve():
        raise UsageError(f"{cf.path}: claim {claim.name!r}: file = {claim.args['file']!r} is the claims file "
                         f"itself; a baseline needs its own file")
    if p.suffix != ".json":
        raise UsageError(f"{cf.path}: claim {claim.name!r}: file = {claim.args['file']!r}: a baseline is a JSON "
                         f"file; name it *.json")
    return p


def _verify(config: Mapping[str, Any]) -> dict:
    exp = Experiment(config["scenario"], config["strategy"], as_mesh(config["mesh"]), config.get("size"),
                     as_overrides(config.get("set")))
    return run_local(exp)


def evaluate(cf: ClaimsFile, *, update_baselines: bool = False,
             predict: Callable[..., Any] | None = None, on_claim: Callable[[Claim], None] | None = None
             ) -> tuple[list[Outcome], list[Path]]:
    """Every claim's outcome, in file order, and the baseline files written (``update_baselines``)."""
    price = predict or model_predict
    cache: dict[str, Any] = {}

    def pred(name: str) -> Any:
        if name not in cache:
            c = cf.configs[name]
            cache[name] = price(c["scenario"], c["strategy"], c["mesh"], c.get("hardware", "tpu-v4"),
                                  size=c.get("size"), set=c.get("set"), stack=c.get("stack", "xla"),
                                  placement=c.get("placement"), overlap=c.get("overlap", True), label=name)
        return cache[name]

    written: list[Path] = []
    outcomes = []
    for claim in cf.claims:
        if on_claim is not None:
            on_claim(claim)
        t0 = time.perf_counter()
        x, *rest = claim.configs
        try:
            if claim.kind == "faster":
                a.assert_faster(pred(x), pred(rest[0]), by=float(claim.args.get("by", 0.0)))
            elif claim.kind == "fits":
                a.assert_fits(pred(x), claim.args.get("hbm"))
            elif claim.kind == "within":
                a.assert_within(pred(x), float(claim.args["measured_s"]), float(claim.args.get("rel", 0.08)))
            elif claim.kind == "collectives":
                a.assert_collectives(pred(x), claim.args["expect"], only=bool(claim.args.get("only", False)))
            elif claim.kind == "baseline":
                path = baseline_path(cf, claim)
                b = Baselines(path.parent, path.stem, update=update_baselines,
                              tolerances=claim.args.get("tolerances"), update_with=UPDATE_HOW)
                b.check(pred(x))
                written += b.written
            else:
                a.assert_verified(_verify(cf.configs[x]))
            outcomes.append(Outcome(claim, "pass", seconds=time.perf_counter() - t0))
        except ClaimFailed as exc:
            outcomes.append(Outcome(claim, "fail", str(exc), time.perf_counter() - t0))
        except PartirError as exc:
            outcomes.append(Outcome(claim, "error", f"{type(exc).__name__}: {exc}", time.perf_counter() - t0))
    return outcomes, written


__all__ = ["Claim", "ClaimsFile", "Outcome", "baseline_path", "evaluate", "load_claims"]
