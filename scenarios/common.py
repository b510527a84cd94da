"""What every scenario shares: the ``Scenario`` record, sizes, Adam, input
naming and the registry (the strategy builder is :mod:`scenarios.strategies`).

A scenario's step is ``step(params, opt, batch) -> (loss, new_params, new_opt)``
with ``params``, ``opt`` and ``batch`` nested dicts of arrays. The compiler
names inputs by pytree path with the argument name first, e.g.
``params/layer_3/mlp/w_in``, ``opt/mu/layer_3/mlp/w_in``, ``opt/count``,
``batch/tokens`` (see :func:`input_names`). Strategies are written against
those names with shell globs (``*`` also matches ``/``).

A scenario whose step is not a training step names its own state argument: an inference
step is ``step(params, cache, batch) -> (logits, new_cache)`` (``Scenario.state_name``,
``state_shapes``, ``make_state``, ``state_outputs``; ``training=False``: no ``grads_only``, so
strict mode checks the step itself elementwise).

Strategies are functions ``strategy(mesh, cfg=None) -> list[ManualPartition]``.
Data axes are every mesh axis except ``model``, in mesh order; the model axis
is ``model``. Without ``cfg`` the dims are the static defaults documented in
:func:`scenarios.strategies.build_strategy`; with ``cfg`` they are checked against the real shapes
(and a ZeRO dim that does not divide falls back deterministically).
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.compiler.tactics import ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.training import adam_init, adam_layout
from scenarios.trees import input_names, leaves, map_leaves, map_shapes, path_name

Config = dict[str, Any]      # size name -> int (sizes, 0/1 switches) or str (choices, e.g. precision="bf16")
Strategy = Callable[..., list[ManualPartition]]

MODEL_AXIS = "model"


# -- the scenario record ------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamKind:
    """One family of parameters that share a shape, e.g. every layer's ``attn/w_q``.

    ``pattern`` is a glob below ``params/`` (and below ``opt/mu/``, ``opt/nu/``);
    ``mp_dim`` is the dim Megatron tensor parallelism shards on the ``model``
    axis (``None``: replicated on ``model``). ``stacked``: dim 0 stacks the
    layers of a model written as a loop over layers (``lax.scan``); it is the
    iteration dim, which ZeRO never shards (each layer's slice is sharded instead).
    """

    pattern: str
    rank: int
    mp_dim: int | None = None
    stacked: bool = False
    emb_dim: int | None = None      # the vocabulary dim of an embedding/unembedding table (``emb``)
    ep_dim: int | None = None       # the expert dim of a mixture of experts' stacked weights (``ep``)


# (cfg or None for the static defaults, size of the model axis or 1) -> the kinds of that config
KindsFn = Callable[[Config | None, int], Sequence[ParamKind]]


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    size_names: tuple[str, ...]                 # names accepted by ``--set``
    presets: Mapping[str, Config]               # preset name -> full size dict
    simulation_only: frozenset[str]             # presets too big to emulate
    make_step: Callable[..., Callable]          # make_step(cfg, *, lr=..., grads_only=False) -> step
    param_shapes: Callable[[Config], dict]      # cfg -> nested dict of shape tuples
    batch_shapes: Callable[[Config], dict]      # cfg -> nested dict of (shape, dtype)
    make_params: Callable[[Config, np.random.Generator], dict]
    make_batch: Callable[[Config, np.random.Generator], dict]
    param_count: Callable[[Config], int]        # closed-form formula
    # model FLOPs of one training step (forward + backward, no recomputation, no elementwise
    # FLOPs): the numerator of MFU; each scenario's docstring states its formula
    model_flops: Callable[[Config], int]
    param_kinds: tuple[ParamKind, ...]          # the default config's kinds (see param_kinds_for)
    strategies: Mapping[str, Strategy] = field(default_factory=dict)
    check_config: Callable[[Config], None] | None = None
    default_preset: str = "tiny"
    flag_names: tuple[str, ...] = ()            # sizes that are 0/1 switches (e.g. remat)
    float_names: tuple[str, ...] = ()           # sizes that are positive numbers (e.g. capacity_factor=1.25)
    # strategies built on request that ``list`` shows beside the listed ones, with when they apply
    strategy_notes: Mapping[str, str] = field(default_factory=dict)
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # string sizes -> allowed values
    # fills sizes whose default depends on others (after overrides, before check_config)
    complete_config: Callable[[Config], Config] | None = None
    # the parameter kinds of a config on a model axis of that size, when they depend on it
    param_kinds_for: KindsFn | None = None
    # what the lowered program's ``meta`` records of a config (e.g. a pipeline's stash as a ring buffer,
    # partir_emu.hwmodels.ring_buffers); None: nothing
    program_meta: Callable[[Config], dict] | None = None
    # -- the step's state, its second argument ------------------------------------------------
    # training: Adam's ``opt`` (mu and nu shaped like the parameters, and a count); inference: a KV
    # ``cache``. ``state_shapes``: cfg -> nested dict of (shape, dtype), None for Adam's;
    # ``make_state``: (cfg, params, rng) -> numpy state, None for ``adam_init(params)``.
    state_name: str = "opt"
    state_shapes: Callable[[Config], dict] | None = None
    make_state: Callable[[Config, dict, np.random.Generator], dict] | None = None
    # output prefix -> the input prefix whose layout it keeps (the next step consumes it)
    state_outputs: Mapping[str, str] = field(default_factory=lambda: dict(STATE_OUTPUTS))
    # a training step: ``make_step`` takes ``grads_only`` (strict mode stops before the optimizer)
    training: bool = True
    # cfg -> the parameters' dtype (None: float32, the master weights of a training step;
    # inference serves bfloat16 weights); ``make_params`` returns that dtype
    param_dtype: Callable[[Config], Any] | None = None

    @property
    def arg_names(self) -> tuple[str, str, str]:
        """The step's argument names, which prefix its input names: params, the state, batch."""
        return ("params", self.state_name, "batch")

    def build_step(self, cfg: Config, *, strict: bool = False) -> Callable:
        """The step of ``cfg``; ``strict`` stops a training step before the optimizer (a
        non-training step is the same step: strict mode then only tightens the verdict)."""
        return self.make_step(cfg, grads_only=strict) if self.training else self.make_step(cfg)

    def state_layout(self, cfg: Config) -> dict:
        """The state as a nested dict of ``(shape, dtype)`` (numpy only, nothing allocated)."""
        if self.state_shapes is not None:
            return self.state_shapes(cfg)
        return adam_layout(self.param_shapes(cfg))

    def state_bytes(self, cfg: Config) -> int:
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in leaves(self.state_layout(cfg)))

    # -- inputs ----------------------------------------------------------------------------
    def make_inputs(self, cfg: Config, seed: int = 0) -> tuple[dict, dict, dict]:
        """Real ``(params, state, batch)`` as numpy pytrees (float32 / int32); the state is Adam's
        ``opt`` unless the scenario has its own (``make_state``)."""
        rng = np.random.default_rng(seed)
        params = self.make_params(cfg, rng)
        state = adam_init(params) if self.make_state is None else self.make_state(cfg, params, rng)
        return params, state, self.make_batch(cfg, rng)

    def abstract_inputs(self, cfg: Config) -> tuple[dict, dict, dict]:
        """``(params, state, batch)`` as ``jax.ShapeDtypeStruct`` pytrees (nothing allocated)."""
        import jax

        def sds(shape, dtype=np.float32):
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

        pdtype = np.float32 if self.param_dtype is None else self.param_dtype(cfg)
        params = map_shapes(self.param_shapes(cfg), lambda s: sds(s, pdtype))
        state = map_leaves(self.state_layout(cfg), lambda sd: sds(*sd))
        batch = map_leaves(self.batch_shapes(cfg), lambda sd: sds(*sd))
        return params, state, batch

    def input_names(self, cfg: Config) -> list[str]:
        return input_names(*self.abstract_inputs(cfg), arg_names=self.arg_names)

    def input_shapes(self, cfg: Config) -> dict[str, tuple[int, ...]]:
        """Input name -> global shape, in flattening order."""
        import jax

        out = {}
        for arg, tree in zip(self.arg_names, self.abstract_inputs(cfg)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                out[path_name(arg, path)] = tuple(leaf.shape)
        return out

    # -- sizes and strategies --------------------------------------------------------------
    def config(self, preset: str | None = None, overrides: str | Mapping[str, Any] | None = None) -> Config:
        return resolve_size(self, preset or self.default_preset, overrides)

    def strategy(self, name: str, mesh: Mesh, cfg: Config | None = None) -> list[ManualPartition]:
        fn = self.strategies.get(name)
        compose = getattr(self.strategies, "compose", None)     # scenarios.strategies.Strategies
        if fn is None and compose is not None:
            fn = compose(name)            # any combination of the parts; build_strategy checks them
        if fn is None:
            raise ScenarioError(f"scenario {self.name!r} has no strategy {name!r}; "
                                f"its strategies are {sorted(self.strategies)}"
                                + ("; other combinations of their parts are built too (bp+mp+sp+z3, ZeRO over "
                                   "some data axes only: bp+z3@batch)" if compose else ""))
        return fn(mesh, cfg)

    def carries(self, name: str, mesh: Mesh, cfg: Config | None = None) -> bool:
        """Whether strategy ``name`` builds on ``mesh``: the mesh has every axis it acts on."""
        try:
            self.strategy(name, mesh, cfg if cfg is not None else self.config())
        except ScenarioError:
            return False
        return True

    def first_mesh(self, name: str, meshes: Sequence[str]) -> str:
        """The first of ``meshes`` (``"batch=2,model=2"`` ...) that carries strategy ``name``."""
        for mesh in meshes:
            if self.carries(name, Mesh.parse(mesh)):
                return mesh
        raise ScenarioError(f"no mesh of {list(meshes)} carries {self.name} {name}; give one with the axes it needs")


def count_params(shapes: dict) -> int:
    total = 0
    for v in shapes.values():
        total += count_params(v) if isinstance(v, dict) else math.prod(v)
    return total


# -- sizes -----------------------------------------------------------------------------------------

def _parse_overrides(scenario: Scenario, overrides: str | Mapping[str, Any] | None) -> dict[str, Any]:
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    if not isinstance(overrides, str):
        raise ScenarioError(f"size overrides must be a string like 'batch=128,hidden=1024' or a dict, "
                            f"got {overrides!r}")
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in overrides.split(","))):
        name, eq, value = part.partition("=")
        if not eq:
            raise ScenarioError(f"size override {part!r} is not NAME=INT; write e.g. "
                                f"{scenario.size_names[0]}=128; valid names for {scenario.name!r}: "
                                f"{', '.join(scenario.size_names)}")
        key = name.strip()
        if key in out:
            raise ScenarioError(f"size override {key!r} is given twice in {overrides!r} ({key}={out[key]} and "
                                f"{key}={value.strip()}); give each name once")
        out[key] = value.strip()
    return out


MAX_SIZE = 1 << 31
"""The largest size override: above any model dimension (vocabularies of 256k, a million-token
batch), small enough that products of a few sizes stay within int64 element counts."""


def resolve_size(scenario: Scenario | str, preset: str, overrides: str | Mapping[str, Any] | None = None) -> Config:
    """Sizes of ``preset`` with ``overrides`` applied (``"batch=128,hidden=1024"`` or a dict).

    An unknown preset, an unknown size name or a value that is not a positive
    integer raises :class:`ScenarioError` naming it and listing what is valid.
    """
    sc = get_scenario(scenario) if isinstance(scenario, str) else scenario
    if preset not in sc.presets:
        raise ScenarioError(f"scenario {sc.name!r} has no size preset {preset!r}; "
                            f"its presets are {', '.join(sc.presets)}")
    cfg = dict(sc.presets[preset])
    for name, raw in _parse_overrides(sc, overrides).items():
        if name not in sc.size_names:
            raise ScenarioError(f"scenario {sc.name!r} has no size {name!r}; "
                                f"valid names: {', '.join(sc.size_names)}")
        if name in sc.choices:
            cfg[name] = _as_choice(sc, name, raw)
            continue
        if name in sc.flag_names:
            value = {"0": 0, "1": 1, 0: 0, 1: 1}.get(raw.strip() if isinstance(raw, str) else raw)
            if value is None or isinstance(raw, bool):
                raise ScenarioError(f"{name!r} of scenario {sc.name!r} is a switch: use {name}=0 or {name}=1, "
                                    f"got {raw!r}")
            cfg[name] = value
            continue
        if name in sc.float_names:
            cfg[name] = _as_positive_float(sc, name, raw)
            continue
        value = _as_positive_int(raw)
        if value is None:
            raise ScenarioError(f"size {name!r} of scenario {sc.name!r} must be a positive integer, got {raw!r}; "
                                f"valid names: {', '.join(sc.size_names)}")
        if value > MAX_SIZE:
            raise ScenarioError(f"size {name}={str(raw)[:20]}{'...' if len(str(raw)) > 20 else ''} of scenario "
                                f"{sc.name!r} is over {MAX_SIZE:,} (2**31); no dimension of a real model is "
                                f"that large, and element counts must fit 64-bit integers")
        cfg[name] = value
    if sc.complete_config is not None:
        cfg = sc.complete_config(cfg)
    if sc.check_config is not None:
        sc.check_config(cfg)
    return cfg


def _as_choice(sc: Scenario, name: str, raw: Any) -> str:
    """A string size: one of ``sc.choices[name]`` (an int is read as its decimal string)."""
    allowed = sc.choices[name]
    value = str(raw).strip() if isinstance(raw, (str, int, np.integer)) and not isinstance(raw, bool) else None
    if value not in allowed:
        raise ScenarioError(f"{name!r} of scenario {sc.name!r} must be one of {'|'.join(allowed)}, got {raw!r}; "
                            f"write e.g. {name}={allowed[0]}")
    return value


def _as_positive_float(sc: Scenario, name: str, raw: Any) -> float:
    """A number size (``capacity_factor=1.25``): finite, above 0 and at most :data:`MAX_SIZE`."""
    text = str(raw).strip() if isinstance(raw, (str, int, float, np.integer, np.floating)) \
        and not isinstance(raw, bool) else ""
    try:
        value = float(text) if 0 < len(text) <= 24 else math.nan
    except ValueError:
        value = math.nan
    if not (0 < value <= MAX_SIZE):      # NaN fails too
        raise ScenarioError(f"{name!r} of scenario {sc.name!r} must be a positive number, got {raw!r}; "
                            f"write e.g. {name}=1.25")
    return value


def _as_positive_int(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, np.integer)):
        value = int(raw)
    elif isinstance(raw, str):
        if len(raw.strip().lstrip("+-")) > 12:             # (int() of thousands of digits is slow)
            return MAX_SIZE + 1 if raw.strip().isdigit() else None
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            return None
    else:
        return None
    return value if value >= 1 else None


# -- Adam, by hand ---------------------------------------------------------------------------------


# -- strategies ------------------------------------------------------------------------------------

# A train step returns (loss, new_params, new_opt): the new state keeps the layout of the
# state it replaces, so that the next step can consume it (output prefix -> input prefix).
STATE_OUTPUTS = {"1": "params", "2": "opt"}


# -- registry --------------------------------------------------------------------------------------

_MODULES = {
    "mlp": "scenarios.mlp",
    "transformer": "scenarios.transformer.scenario",
    "inference": "scenarios.inference.scenario",
    "unet": "scenarios.unet.scenario",
    "gns": "scenarios.gns.scenario",
}


def list_scenarios() -> list[str]:
    return sorted(_MODULES)


def get_scenario(name: str) -> Scenario:
    if name not in _MODULES:
        raise ScenarioError(f"unknown scenario {name!r}; scenarios are {', '.join(list_scenarios())}")
    return importlib.import_module(_MODULES[name]).SCENARIO
