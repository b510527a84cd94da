"""The published measurements ``partir-emu fidelity`` checks against, and the FLOP conventions that
turn each published number into a step time.

The data live in ``partir_emu/app/data/fidelity.toml`` (package data): one ``[[case]]`` per
published run, with its source, hardware, mesh, strategy, the transformer ``--set`` keys of the
model, the measured number, its metric and the source's FLOP-counting convention. :func:`load_cases`
reads and checks the file; every problem is a :class:`FidelityDataError` naming the file, the case
and the field.

The conventions (``F`` = FLOPs of one training step, over all chips; ``B`` global batch in
sequences, ``s`` sequence length, ``l`` layers, ``h`` d_model, ``V`` vocabulary, ``N`` parameter
count, ``H`` heads, ``dh`` head width):

- ``megatron_eq3`` (arXiv 2104.04473 eq. 3; counts the recomputed forward pass of full
  activation recomputation): ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``;
- ``maxtext_6n`` (MaxText train.py, 2023-04): ``F = 6·N·B·s``;
- ``maxtext_6n_attn`` (MaxText ``calculate_training_tflops`` from 2023-06):
  ``F = 6·N·B·s + 12·H·l·dh·s²·B``;
- ``iteration_time``: the source reports the step time itself;
- ``tokens``: the source reports tokens per second over all chips: ``step_s = B·s / measured``.

A number in TFLOP/s per chip becomes a step time ``step_s = F / (measured·1e12 · chips)``; a
predicted step time becomes the source's metric the same way backwards (:func:`to_metric`).
``N`` is the scenario's own parameter count of the configuration (``Scenario.param_count``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from partir_emu.errors import PartirError
from partir_emu.limits import load_toml

DATA_FILE = "fidelity.toml"
GROUPS = ("required", "extra")
METRICS = ("tflops_per_chip", "step_s", "tokens_per_s")


class FidelityDataError(PartirError):
    """The fidelity data file is unreadable, or one of its cases is malformed or unknown."""


# -- the FLOP conventions ---------------------------------------------------------------------------
def _megatron_eq3(cfg: Mapping[str, Any], n_params: int) -> float:
    b, s, layers, h, v = cfg["batch"], cfg["seq"], cfg["layers"], cfg["d_model"], cfg["vocab"]
    return 96.0 * b * s * layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * layers * h))


def _maxtext_6n(cfg: Mapping[str, Any], n_params: int) -> float:
    return 6.0 * n_params * cfg["batch"] * cfg["seq"]


def head_dim(cfg: Mapping[str, Any]) -> int:
    """The attention head width: ``head_dim`` if the config has one, else ``d_model // heads``."""
    return int(cfg.get("head_dim") or cfg["d_model"] // cfg["heads"])


def _maxtext_6n_attn(cfg: Mapping[str, Any], n_params: int) -> float:
    s = cfg["seq"]
    return _maxtext_6n(cfg, n_params) + 12.0 * cfg["heads"] * cfg["layers"] * head_dim(cfg) * s * s * cfg["batch"]


def _maxtext_6n_causal(cfg: Mapping[str, Any], n_params: int) -> float:
    s = cfg["seq"]
    return _maxtext_6n(cfg, n_params) + 6.0 * cfg["heads"] * cfg["layers"] * head_dim(cfg) * s * s * cfg["batch"]


@dataclass(frozen=True)
class Convention:
    """How a source counts the FLOPs of a step; ``flops`` is None when it reports the step time."""

    name: str
    formula: str
    metric: str
    flops: Callable[[Mapping[str, Any], int], float] | None


CONVENTIONS: dict[str, Convention] = {c.name: c for c in (
    Convention("megatron_eq3", "F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) per step (arXiv 2104.04473 eq. 3)",
               "tflops_per_chip", _megatron_eq3),
    Convention("maxtext_6n", "F = 6·N·B·s per step (MaxText train.py, 2023-04)", "tflops_per_chip", _maxtext_6n),
    Convention("maxtext_6n_attn", "F = 6·N·B·s + 12·H·l·dh·s²·B per step (MaxText calculate_training_tflops, "
               "2023-06 on)", "tflops_per_chip", _maxtext_6n_attn),
    Convention("maxtext_6n_causal", "F = 6·N·B·s + 6·H·l·dh·s²·B per step (MaxText calculate_training_tflops "
               "from 2023-11-29, 64ee4e938: causal attention FLOPs halved)", "tflops_per_chip", _maxtext_6n_causal),
    Convention("iteration_time", "the source reports seconds per iteration", "step_s", None),
    Convention("tokens", "the source reports tokens per second over all chips: step_s = B·s / measured",
               "tokens_per_s", None),
)}


# -- one case -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PublishedRun:
    """One published run (see the header of ``fidelity.toml`` for the fields)."""

    case: str
    group: str
    source: str
    hardware: str
    chips: int
    strategy: str
    mesh: tuple[tuple[str, int], ...]
    global_batch: int
    set: tuple[tuple[str, Any], ...]
    measured: float
    metric: str
    convention: str
    stack: str = "xla"
    source_key: str = ""               # the published table (``source_id``); "" : from ``source``
    published_mfu: float | None = None
    published_hfu: float | None = None
    notes: str = ""
    scenario: str = "transformer"
    placement: str | None = None
    slice: str | None = None           # TPU slice shape; a leading extra dim counts slices over DCN ("2x16x16")
    one_slice: str | None = None       # a run on several slices: the same model on one slice (another case)
    where: str = field(default="", compare=False)

    @property
    def slice_dims(self) -> tuple[int, ...] | None:
        return tuple(int(x) for x in self.slice.split("x")) if self.slice else None

    @property
    def overrides(self) -> str:
        """The ``--set`` string of the model, as a user would type it."""
        return ",".join(f"{k}={v}" for k, v in self.set)

    @property
    def mesh_text(self) -> str:
        """The ``--mesh`` string, e.g. ``batch=32,model=4``."""
        return ",".join(f"{k}={v}" for k, v in self.mesh)

    def flops_per_step(self, cfg: Mapping[str, Any], n_params: int) -> float | None:
        """FLOPs of one step by the source's convention (None for ``iteration_time``)."""
        fn = CONVENTIONS[self.convention].flops
        return None if fn is None else fn(cfg, n_params)

    @property
    def source_id(self) -> str:
        """The published table this run comes from (the groups of ``--holdout source``)."""
        return self.source_key or self.source.split(",", 1)[0].strip()

    @property
    def tokens_per_step(self) -> int:
        return int(dict(self.set)["batch"]) * int(dict(self.set)["seq"])

    def measured_step_s(self, flops: float | None) -> float:
        """The published number as seconds per step."""
        if self.metric == "step_s":
            return self.measured
        if self.metric == "tokens_per_s":
            return self.tokens_per_step / self.measured
        assert flops is not None, "a TFLOP/s metric always has a FLOP convention (checked at load)"
        return flops / (self.measured * 1e12 * self.chips)

    def to_metric(self, step_s: float, flops: float | None) -> float:
        """A step time in this case's metric (the inverse of :meth:`measured_step_s`)."""
        if self.metric == "step_s":
            return step_s
        if self.metric == "tokens_per_s":
            return self.tokens_per_step / step_s
        assert flops is not None, "a TFLOP/s metric always has a FLOP convention (checked at load)"
        return flops / (step_s * self.chips) / 1e12


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "case": str, "group": str, "source": str, "hardware": str, "chips": int, "strategy": str, "mesh": dict,
    "global_batch": int, "set": dict, "measured": (int, float), "metric": str, "convention": str, "stack": str}
_OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "published_mfu": (int, float), "published_hfu": (int, float), "notes": str, "scenario": str, "placement": str,
    "source_id": str, "slice": str, "one_slice": str}


def _check_fields(d: Any, at: str) -> None:
    if not isinstance(d, dict):
        raise FidelityDataError(f"{at}: a {type(d).__name__}, not a table; write each case as [[case]]")
    unknown = sorted(set(d) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise FidelityDataError(f"{at}: unknown field {unknown[0]!r}; fields are "
                                f"{', '.join(list(_REQUIRED) + list(_OPTIONAL))}")
    for k, types in list(_REQUIRED.items()) + list(_OPTIONAL.items()):
        if k not in d:
            if k in _REQUIRED:
                raise FidelityDataError(f"{at}: field {k!r} is missing")
            continue
        v = d[k]
        if isinstance(v, bool) or not isinstance(v, types):
            want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
            raise FidelityDataError(f"{at}: field {k!r} is {v!r}; it must be a {want}")


def _check_values(d: dict, at: str) -> None:
    if d["group"] not in GROUPS:
        raise FidelityDataError(f"{at}: field 'group' is {d['group']!r}; use one of {', '.join(GROUPS)}")
    if d["metric"] not in METRICS:
        raise FidelityDataError(f"{at}: field 'metric' is {d['metric']!r}; use one of {', '.join(METRICS)}")
    conv = CONVENTIONS.get(d["convention"])
    if conv is None:
        raise FidelityDataError(f"{at}: field 'convention' is {d['convention']!r}; use one of {', '.join(CONVENTIONS)}")
    if conv.metric != d["metric"]:
        raise FidelityDataError(f"{at}: convention {conv.name!r} converts the metric {conv.metric!r}, "
                                f"but the case's metric is {d['metric']!r}")
    if not (math.isfinite(d["measured"]) and d["measured"] > 0):
        raise FidelityDataError(f"{at}: field 'measured' is {d['measured']!r}; it must be a positive number")
    for k in ("published_mfu", "published_hfu"):
        if k in d and not 0 < d[k] <= 1:
            raise FidelityDataError(f"{at}: field {k!r} is {d[k]!r}; write a fraction in (0, 1], e.g. 0.44")
    mesh = d["mesh"]
    if not mesh or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh.values()):
        raise FidelityDataError(f"{at}: field 'mesh' is {mesh!r}; write axis sizes, e.g. {{ batch = 32, model = 4 }}")
    if math.prod(mesh.values()) != d["chips"]:
        raise FidelityDataError(f"{at}: the mesh {mesh} has {math.prod(mesh.values())} devices but 'chips' is "
                                f"{d['chips']}")
    if d["set"].get("batch") != d["global_batch"]:
        raise FidelityDataError(f"{at}: 'global_batch' is {d['global_batch']} but set.batch is "
                                f"{d['set'].get('batch')!r}; the scenario's batch is the global batch")
    if d["metric"] == "tokens_per_s" and not isinstance(d["set"].get("seq"), int):
        raise FidelityDataError(f"{at}: a tokens_per_s case needs set.seq (tokens per step = set.batch * set.seq)")
    if "slice" in d:
        dims = d["slice"].split("x")
        if not all(x.isdigit() and int(x) > 0 for x in dims) or math.prod(map(int, dims)) != d["chips"]:
            raise FidelityDataError(f"{at}: field 'slice' is {d['slice']!r}; write the slice shape as positive "
                                    f"integers joined by 'x' whose product is 'chips' ({d['chips']}), with a "
                                    f"leading count of slices over DCN if several (\"2x16x16\")")
    bad = [k for k, v in d["set"].items() if isinstance(v, bool) or not isinstance(v, (int, str))]
    if bad:
        raise FidelityDataError(f"{at}: set.{bad[0]} is {d['set'][bad[0]]!r}; --set values are integers or words")


def parse_case(d: Any, at: str) -> PublishedRun:
    """One ``[[case]]`` table, checked; errors name ``at`` (file and case) and the field."""
    _check_fields(d, at)
    _check_values(d, at)
    kw = {k: d[k] for k in _OPTIONAL if k in d and k != "source_id"}
    if "source_id" in d:
        kw["source_key"] = d["source_id"]
    for k in ("published_mfu", "published_hfu"):
        if k in kw:
            kw[k] = float(kw[k])
    return PublishedRun(case=d["case"], group=d["group"], source=d["source"], hardware=d["hardware"], chips=d["chips"],
                strategy=d["strategy"], mesh=tuple(d["mesh"].items()), global_batch=d["global_batch"],
                set=tuple(d["set"].items()), measured=float(d["measured"]), metric=d["metric"],
                convention=d["convention"], stack=d["stack"], where=at, **kw)


def default_path() -> Path:
    """The packaged data file."""
    return Path(str(resources.files("partir_emu.app").joinpath("data").joinpath(DATA_FILE)))


def load_cases(path: str | Path | None = None) -> list[PublishedRun]:
    """Every case of the data file (default: the packaged one), checked, in file order."""
    path = Path(path) if path is not None else default_path()
    doc = load_toml(path, FidelityDataError, "fidelity data file")
    unknown = sorted(set(doc) - {"case"})
    if unknown:
        raise FidelityDataError(f"fidelity data {path}: unknown top-level key {unknown[0]!r}; write each case as [[case]]")
    raw = doc.get("case")
    if not isinstance(raw, list) or not raw:
        raise FidelityDataError(f"fidelity data {path}: no cases; write each case as a [[case]] table")
    cases, seen = [], set()
    for i, d in enumerate(raw):
        name = d.get("case") if isinstance(d, dict) else None
        at = f"fidelity data {path}, case {name!r}" if isinstance(name, str) else f"fidelity data {path}, case #{i + 1}"
        c = parse_case(d, at)
        if c.case in seen:
            raise FidelityDataError(f"{at}: the name is used twice; case names must be unique")
        seen.add(c.case)
        cases.append(c)
    _check_one_slice(cases)
    return cases


def _check_one_slice(cases: list[PublishedRun]) -> None:
    """A ``one_slice`` names another case of the file: the same chip and stack on one slice."""
    by_name = {c.case: c for c in cases}
    for c in cases:
        if c.one_slice is None:
            continue
        ref = by_name.get(c.one_slice)
        if ref is None:
            raise FidelityDataError(f"{c.where}: field 'one_slice' names {c.one_slice!r}, which is not a case of the "
                                    f"file; name the same model's run on one slice")
        if ref.hardware != c.hardware or ref.stack != c.stack:
            raise FidelityDataError(f"{c.where}: field 'one_slice' names {ref.case!r}, a run of {ref.hardware} x "
                                    f"{ref.stack}; name a run of the same chip and stack ({c.hardware} x {c.stack})")
        if ref.one_slice is not None or len(ref.slice_dims or ()) > len(c.slice_dims or ()) - 1:
            raise FidelityDataError(f"{c.where}: field 'one_slice' names {ref.case!r}, which does not run on one "
                                    f"slice; name the same model's single-slice run")


def select(cases: list[PublishedRun], names: list[str] | None = None, group: str = "required") -> list[PublishedRun]:
    """The cases named (in the order given), else those of ``group`` (``required``, ``extra``, ``all``)."""
    if names:
        by_name = {c.case: c for c in cases}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise FidelityDataError(f"--case {missing[0]!r}: no such case; cases are {', '.join(by_name)}")
        return [by_name[n] for n in dict.fromkeys(names)]
    if group == "all":
        return list(cases)
    if group not in GROUPS:
        raise FidelityDataError(f"--group {group!r}: use one of {', '.join(GROUPS)}, all")
    return [c for c in cases if c.group == group]


__all__ = ["CONVENTIONS", "DATA_FILE", "GROUPS", "METRICS", "PublishedRun", "Convention", "FidelityDataError",
           "default_path", "head_dim", "load_cases", "parse_case", "select"]
