"""What every scenario shares: the ``Scenario`` record, sizes, Adam, input
naming, the strategy builder and the registry.

A scenario's step is ``step(params, opt, batch) -> (loss, new_params, new_opt)``
with ``params``, ``opt`` and ``batch`` nested dicts of arrays. The compiler
names inputs by pytree path with the argument name first, e.g.
``params/layer_3/mlp/w_in``, ``opt/mu/layer_3/mlp/w_in``, ``opt/count``,
``batch/tokens`` (see :func:`input_names`). Strategies are written against
those names with shell globs (``*`` also matches ``/``).

Strategies are functions ``strategy(mesh, cfg=None) -> list[ManualPartition]``.
Data axes are every mesh axis except ``model``, in mesh order; the model axis
is ``model``. Without ``cfg`` the dims are the static defaults documented in
:func:`build_strategy`; with ``cfg`` they are checked against the real shapes
(and a ZeRO dim that does not divide falls back deterministically).
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition, ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError

Config = dict[str, Any]      # size name -> int (sizes, 0/1 switches) or str (choices, e.g. precision="bf16")
Strategy = Callable[..., list[ManualPartition]]

MODEL_AXIS = "model"
ARG_NAMES = ("params", "opt", "batch")


# -- the scenario record ------------------------------------------------------------------------

@dataclass(frozen=True)
class ParamKind:
    """One family of parameters that share a shape, e.g. every layer's ``attn/w_q``.

    ``pattern`` is a glob below ``params/`` (and below ``opt/mu/``, ``opt/nu/``);
    ``mp_dim`` is the dim Megatron tensor parallelism shards on the ``model``
    axis (``None``: replicated on ``model``).
    """

    pattern: str
    rank: int
    mp_dim: int | None = None


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
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)   # string sizes -> allowed values
    # fills sizes whose default depends on others (after overrides, before check_config)
    complete_config: Callable[[Config], Config] | None = None
    # the parameter kinds of a config on a model axis of that size, when they depend on it
    param_kinds_for: KindsFn | None = None

    # -- inputs ----------------------------------------------------------------------------
    def make_inputs(self, cfg: Config, seed: int = 0) -> tuple[dict, dict, dict]:
        """Real ``(params, opt, batch)`` as numpy pytrees (float32 / int32)."""
        rng = np.random.default_rng(seed)
        params = self.make_params(cfg, rng)
        return params, adam_init(params), self.make_batch(cfg, rng)

    def abstract_inputs(self, cfg: Config) -> tuple[dict, dict, dict]:
        """``(params, opt, batch)`` as ``jax.ShapeDtypeStruct`` pytrees (nothing allocated)."""
        import jax

        def sds(shape, dtype=np.float32):
            return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))

        params = _map_shapes(self.param_shapes(cfg), sds)
        opt = {"mu": _map_shapes(self.param_shapes(cfg), sds),
               "nu": _map_shapes(self.param_shapes(cfg), sds),
               "count": sds((), np.int32)}
        batch = _map_leaves(self.batch_shapes(cfg), lambda sd: sds(*sd))
        return params, opt, batch

    def input_names(self, cfg: Config) -> list[str]:
        return input_names(*self.abstract_inputs(cfg))

    def input_shapes(self, cfg: Config) -> dict[str, tuple[int, ...]]:
        """Input name -> global shape, in flattening order."""
        import jax

        out = {}
        for arg, tree in zip(ARG_NAMES, self.abstract_inputs(cfg)):
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
                out[_path_name(arg, path)] = tuple(leaf.shape)
        return out

    # -- sizes and strategies --------------------------------------------------------------
    def config(self, preset: str | None = None, overrides: str | Mapping[str, Any] | None = None) -> Config:
        return resolve_size(self, preset or self.default_preset, overrides)

    def strategy(self, name: str, mesh: Mesh, cfg: Config | None = None) -> list[ManualPartition]:
        if name not in self.strategies:
            raise ScenarioError(f"scenario {self.name!r} has no strategy {name!r}; "
                                f"its strategies are {sorted(self.strategies)}")
        return self.strategies[name](mesh, cfg)


def _map_shapes(tree: dict, fn: Callable) -> dict:
    return {k: (_map_shapes(v, fn) if isinstance(v, dict) else fn(v)) for k, v in tree.items()}


def _map_leaves(tree: dict, fn: Callable) -> dict:
    return {k: (_map_leaves(v, fn) if isinstance(v, dict) else fn(v)) for k, v in tree.items()}


def _path_name(arg: str, path: Sequence[Any]) -> str:
    parts = [arg]
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def input_names(params: Any, opt: Any, batch: Any) -> list[str]:
    """Input names the compiler gives the step's flattened arguments:
    argument name, then the pytree path joined by ``/``."""
    import jax

    names = []
    for arg, tree in zip(ARG_NAMES, (params, opt, batch)):
        names += [_path_name(arg, p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return names


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
        out[name.strip()] = value.strip()
    return out


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
        value = _as_positive_int(raw)
        if value is None:
            raise ScenarioError(f"size {name!r} of scenario {sc.name!r} must be a positive integer, got {raw!r}; "
                                f"valid names: {', '.join(sc.size_names)}")
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


def _as_positive_int(raw: Any) -> int | None:
    if isinstance(raw, bool):
        return None
    if isinstance(raw, (int, np.integer)):
        value = int(raw)
    elif isinstance(raw, str):
        try:
            value = int(raw.strip(), 10)
        except ValueError:
            return None
    else:
        return None
    return value if value >= 1 else None


# -- Adam, by hand ---------------------------------------------------------------------------------

def adam_init(params: Any) -> dict:
    """``{"mu": zeros like params, "nu": zeros like params, "count": int32 0}``.

    Works on numpy arrays (returns numpy, without importing jax: MPI ranks build
    their inputs this way) and on jax arrays/tracers (returns jax).
    """
    def leaves(t):
        return [x for v in t.values() for x in leaves(v)] if isinstance(t, dict) else [t]

    if all(isinstance(x, np.ndarray) for x in leaves(params)):
        def zeros(t):
            return _map_leaves(t, lambda x: np.zeros(x.shape, x.dtype)) if isinstance(t, dict) \
                else np.zeros(t.shape, t.dtype)
        return {"mu": zeros(params), "nu": zeros(params), "count": np.zeros((), np.int32)}
    import jax
    import jax.numpy as jnp
    return {"mu": jax.tree.map(jnp.zeros_like, params), "nu": jax.tree.map(jnp.zeros_like, params),
            "count": jnp.zeros((), jnp.int32)}


def train_step(loss_fn: Any, *, lr: float, grads_only: bool = False) -> Any:
    """``(params, opt, batch) -> (loss, new_params, new_opt)``: value_and_grad of ``loss_fn`` then
    :func:`adam_update`; with ``grads_only`` stopped before the optimizer: ``-> (loss, grads)``."""
    import jax

    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if grads_only:
            return loss, grads
        new_params, new_opt = adam_update(grads, opt, params, lr=lr)
        return loss, new_params, new_opt

    return step


def adam_update(grads: Any, state: dict, params: Any, *, lr: float = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, dict]:
    """One Adam step with bias correction. Returns ``(new_params, new_state)``."""
    import jax
    import jax.numpy as jnp

    count = state["count"] + jnp.int32(1)
    t = count.astype(jnp.float32)
    # b ** t written as exp(t * log b): only exp and mul, no pow.
    bc1 = 1.0 - jnp.exp(t * np.float32(math.log(b1)))
    bc2 = 1.0 - jnp.exp(t * np.float32(math.log(b2)))
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
    new_params = jax.tree.map(lambda p, m, v: p - lr * (m / bc1) / (jnp.sqrt(v / bc2) + eps), params, mu, nu)
    return new_params, {"mu": mu, "nu": nu, "count": count}


# -- strategies ------------------------------------------------------------------------------------

# A train step returns (loss, new_params, new_opt): the new state keeps the layout of the
# state it replaces, so that the next step can consume it (output prefix -> input prefix).
STATE_OUTPUTS = {"1": "params", "2": "opt"}


def data_axes(mesh: Mesh) -> list[str]:
    return [a for a in mesh.axis_names if a != MODEL_AXIS]


def _check_mesh(mesh: Mesh, strategy: str, *, need_data: bool, need_model: bool) -> None:
    if not isinstance(mesh, Mesh):
        raise ScenarioError(f"strategy {strategy!r} takes a partir_emu Mesh, got {mesh!r}")
    if need_model and MODEL_AXIS not in mesh.axis_names:
        raise ScenarioError(f"strategy {strategy!r} needs mesh axis {MODEL_AXIS!r}, which {mesh} lacks; "
                            f"add it, e.g. --mesh batch=2,{MODEL_AXIS}=2")
    if need_data and not data_axes(mesh):
        raise ScenarioError(f"strategy {strategy!r} needs a data axis (any mesh axis other than "
                            f"{MODEL_AXIS!r}), which {mesh} lacks; add one, e.g. --mesh batch=2,{MODEL_AXIS}=2")


def _kind_shapes(scenario_param_shapes: dict, kinds: Sequence[ParamKind]) -> dict[str, list[tuple[int, ...]]]:
    """The distinct shapes each kind has in a config (usually one; e.g. an MLP's last block differs)."""
    import fnmatch

    flat: dict[str, tuple[int, ...]] = {}

    def walk(tree, prefix):
        for k, v in tree.items():
            name = f"{prefix}/{k}" if prefix else k
            if isinstance(v, dict):
                walk(v, name)
            else:
                flat[name] = tuple(v)

    walk(scenario_param_shapes, "")
    out = {}
    for kind in kinds:
        shapes = sorted({s for n, s in flat.items() if fnmatch.fnmatchcase(n, kind.pattern)})
        if not shapes or any(len(s) != kind.rank for s in shapes):
            raise ScenarioError(f"parameter kind {kind.pattern!r} of rank {kind.rank} matches shapes {shapes}")
        out[kind.pattern] = shapes
    return out


def build_strategy(name: str, mesh: Mesh, cfg: Config | None, *, kinds: Sequence[ParamKind] | KindsFn,
                   param_shapes: Callable[[Config], dict], batch_patterns: Sequence[str] = ("batch/*",),
                   batch_size: Callable[[Config], int] = lambda c: c["batch"],
                   check_mp: Callable[[Config, int], None] | None = None) -> list[ManualPartition]:
    """The tactics of strategy ``name``: parts ``bp``, ``mp``, ``z2``, ``z3`` joined by ``+``.

    Tactic order: bp (one per data axis), then mp (on ``model``), then z2/z3
    (one per data axis).

    - ``bp``: ``batch/*`` dim 0 on each data axis.
    - ``mp``: each kind with an ``mp_dim`` (column-parallel weights dim 1,
      their biases dim 0, row-parallel weights dim 0), its ``mu``/``nu`` alike.
    - ``z3``: every parameter and its ``mu``/``nu`` on each data axis; ``z2``:
      only ``mu``/``nu``. Default dim 0, except a matrix already sharded on
      ``model`` uses its other dim (a 1-D vector stacks the data axis after
      ``model`` on dim 0). With ``cfg``, a dim whose size is not divisible by
      the product of the axes on it falls back to the largest divisible dim
      (lowest index on ties, never the model dim of a matrix); a parameter with
      no such dim stays replicated on that axis. Scalars are never sharded.

    ``kinds`` may be a function ``(cfg, model axis size) -> kinds`` when which parameters exist,
    and which of them Megatron shards, depend on the config (``cfg=None``: the static defaults).
    """
    parts = name.split("+")
    unknown = [p for p in parts if p not in ("bp", "mp", "z2", "z3", "auto")]
    if unknown or len(set(parts)) != len(parts) or ("z2" in parts and "z3" in parts) \
            or ("auto" in parts and "mp" in parts):
        raise ScenarioError(f"strategy {name!r} is not a combination of bp, mp (or auto), z2, z3")
    use_mp = "mp" in parts
    use_auto = "auto" in parts
    zero = "z3" if "z3" in parts else "z2" if "z2" in parts else None
    use_bp = "bp" in parts or zero is not None          # ZeRO is data parallelism with sharded state
    _check_mesh(mesh, name, need_data=use_bp, need_model=use_mp or use_auto)
    daxes = data_axes(mesh)
    if callable(kinds):
        kinds = tuple(kinds(cfg, mesh.axis_size(MODEL_AXIS) if MODEL_AXIS in mesh.axis_names else 1))
    shapes = _kind_shapes(param_shapes(cfg), kinds) if cfg is not None else None
    tactics: list[ManualPartition] = []

    if use_bp:
        if cfg is not None:
            group = mesh.group_size(daxes)
            if batch_size(cfg) % group:
                raise ScenarioError(f"strategy {name!r}: batch {batch_size(cfg)} is not divisible by the data "
                                    f"axes {daxes} of {mesh} (product {group}); change --set batch=...")
        for ax in daxes:
            tactics.append(ManualPartition({p: 0 for p in batch_patterns}, axis=ax, name=f"bp:{ax}"))

    # how many devices already tile each dim of each kind
    tiled: dict[str, dict[int, int]] = {k.pattern: {} for k in kinds}
    if use_mp:
        msize = mesh.axis_size(MODEL_AXIS)
        if cfg is not None and check_mp is not None:
            check_mp(cfg, msize)
        inputs: dict[str, int] = {}
        for k in kinds:
            if k.mp_dim is None:
                continue
            bad = [s for s in (shapes[k.pattern] if shapes else []) if s[k.mp_dim] % msize]
            if bad:
                raise ScenarioError(f"strategy {name!r}: dim {k.mp_dim} of params/{k.pattern} "
                                    f"(shape {bad[0]}) is not divisible by axis {MODEL_AXIS!r} of size {msize}; "
                                    "change the sizes or the mesh")
            inputs[f"params/{k.pattern}"] = k.mp_dim
            inputs[f"opt/*/{k.pattern}"] = k.mp_dim
            tiled[k.pattern][k.mp_dim] = msize
        tactics.append(ManualPartition(inputs, axis=MODEL_AXIS, name=f"mp:{MODEL_AXIS}"))
    if use_auto:
        # the model axis searched instead of written: the caller's cost model prices each choice
        # (partir_emu.api passes the analytical model, on this tactic's hardware)
        tactics.append(AutomaticPartition(MODEL_AXIS, inputs="params/*", name=f"auto:{MODEL_AXIS}",
                                          hardware="tpu-v4"))

    if zero is not None:
        for ax in daxes:
            size = mesh.axis_size(ax)
            inputs = {}
            for k in kinds:
                if k.rank == 0:
                    continue
                d = _zero_dim(k, use_mp, size, tiled[k.pattern], shapes[k.pattern] if shapes else None)
                if d is None:
                    continue
                tiled[k.pattern][d] = tiled[k.pattern].get(d, 1) * size
                if zero == "z3":
                    inputs[f"params/{k.pattern}"] = d
                inputs[f"opt/*/{k.pattern}"] = d
            if zero == "z2":
                # ZeRO-2 keeps parameters replicated: without the pin, propagation would carry
                # the optimizer-state tiling backward through the update into the parameters.
                inputs["params/*"] = REPLICATED
            if inputs:
                tactics.append(ManualPartition(inputs, axis=ax, name=f"{zero}:{ax}"))
    return tactics


def _zero_dim(kind: ParamKind, use_mp: bool, size: int, tiled: dict[int, int],
              shapes: list[tuple[int, ...]] | None) -> int | None:
    model_dim = kind.mp_dim if (use_mp and kind.rank >= 2) else None
    default = 0
    if model_dim is not None:
        default = next(d for d in range(kind.rank) if d != model_dim)
    if shapes is None:
        return default
    fits = lambda d: all(s[d] % (tiled.get(d, 1) * size) == 0 for s in shapes)
    if fits(default):
        return default
    candidates = [d for d in range(kind.rank) if d != model_dim and fits(d)]
    if not candidates:
        return None
    return min(candidates, key=lambda d: (-min(s[d] for s in shapes), d))


STRATEGY_NAMES = ("bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z2", "bp+mp+z3", "bp+auto")


def make_strategies(kinds: Sequence[ParamKind] | KindsFn, param_shapes: Callable[[Config], dict], *,
                    check_mp: Callable[[Config, int], None] | None = None,
                    names: Sequence[str] = STRATEGY_NAMES) -> dict[str, Strategy]:
    """``{name: strategy(mesh, cfg=None) -> list[ManualPartition]}`` for the standard names."""

    def make(n: str) -> Strategy:
        def strategy(mesh: Mesh, cfg: Config | None = None) -> list[ManualPartition]:
            return build_strategy(n, mesh, cfg, kinds=kinds, param_shapes=param_shapes, check_mp=check_mp)
        strategy.__name__ = strategy.__qualname__ = f"strategy_{n.replace('+', '_')}"
        strategy.__doc__ = f"Strategy {n!r}: see scenarios.common.build_strategy."
        return strategy

    return {n: make(n) for n in names}


# -- registry --------------------------------------------------------------------------------------

_MODULES = {
    "mlp": "scenarios.mlp",
    "transformer": "scenarios.transformer",
}


def list_scenarios() -> list[str]:
    return sorted(_MODULES)


def get_scenario(name: str) -> Scenario:
    if name not in _MODULES:
        raise ScenarioError(f"unknown scenario {name!r}; scenarios are {', '.join(list_scenarios())}")
    return importlib.import_module(_MODULES[name]).SCENARIO
