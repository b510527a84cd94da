"""Named strategies: ``bp``, ``mp``, ``emb``, ``ep``, ``z2``, ``z3`` and ``auto``, joined by ``+``, built from a
scenario's parameter kinds (:class:`~scenarios.common.ParamKind`) and written against input names
with shell globs (see :mod:`scenarios.common`).

Strategies are functions ``strategy(mesh, cfg=None) -> list[ManualPartition]``. Data axes are every
mesh axis except ``model``, ``stage`` and ``context`` (:mod:`scenarios.stage_context`), in mesh order; the model axis is ``model``. Without ``cfg`` the dims are
the static defaults documented in :func:`build_strategy`; with ``cfg`` they are checked against the
real shapes (and a ZeRO dim that does not divide falls back deterministically).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from partir_emu.compiler.tactics import REPLICATED, AutomaticPartition, ManualPartition
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.common import MODEL_AXIS, Config, KindsFn, ParamKind, Strategy
from scenarios.stage_context import CONTEXT_AXIS, STAGE_AXIS, context_tactic, stage_tactic

PARTS = ("bp", "mp", "sp", "emb", "ep", "pp", "cp", "z2", "z3", "auto")     # what a strategy name is made of, joined by '+'
EXPERT_AXIS = "expert"
# where ``ep`` stops: the tags a mixture-of-experts layer puts on its dispatched tokens and on its
# experts' outputs (scenarios.transformer.moe); the lowering reshards there (all_to_all)
EXPERT_TAGS = ("moe/*",)


def data_axes(mesh: Mesh) -> list[str]:
    return [a for a in mesh.axis_names if a not in (MODEL_AXIS, STAGE_AXIS, CONTEXT_AXIS)]


def check_mesh(mesh: Mesh, strategy: str, *, need_data: bool, need_model: bool) -> None:
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
                   check_mp: Callable[[Config, int], None] | None = None,
                   seq_dim: int | None = None) -> list[ManualPartition]:
    """The tactics of strategy ``name``: parts ``bp``, ``mp``, ``sp``, ``emb``, ``z2``, ``z3`` joined by
    ``+`` (``z2@AXES``/``z3@AXES``: ZeRO over those data axes only, replicated over the others).

    Tactic order: ep (on ``expert``), bp, mp, emb, sp (on ``model``), z2/z3 (bp, z2, z3: one per data axis).

    - ``ep``: GShard's expert parallelism on the ``expert`` axis (:func:`_expert_tactic`).
    - ``pp``, ``cp`` (after sp): :mod:`scenarios.stage_context` (a pipeline's stacked layer weights on
      ``stage``; the batch's sequence on ``context``).
    - ``bp``: ``batch/*`` dim 0 on each data axis.
    - ``mp``: each kind with an ``mp_dim`` (column-parallel weights dim 1,
      their biases dim 0, row-parallel weights dim 0), its ``mu``/``nu`` alike.
    - ``emb``: each kind with an ``emb_dim`` (the vocabulary dim of the embedding and
      unembedding tables) on ``model``: a masked local lookup whose rows are all-reduced, and
      vocab-parallel logits with a sharded softmax cross-entropy (a pending max and sums of
      [batch, seq] values), so no collective carries [batch, seq, vocab] or [vocab, d_model].
    - ``sp``: Megatron's sequence parallelism: ``batch/*`` dim ``seq_dim`` (the sequence; a scenario
      without one refuses sp) on ``model``, after mp, so what mp leaves replicated over ``model``
      (norms, residual stream, loss) is split by sequence; the column-parallel matmuls all-gather their
      input over ``model`` and the row-parallel outputs are reduce-scattered into it (no all-reduce).
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
    parts, zero_axes = _zero_axes(name, mesh)
    unknown = [p for p in parts if p not in PARTS]
    if unknown or len(set(parts)) != len(parts) or ("z2" in parts and "z3" in parts) \
            or ("auto" in parts and ("mp" in parts or "emb" in parts)):
        raise ScenarioError(f"strategy {name!r} is not a combination of bp, mp, sp, ep and emb (or auto), pp, cp, z2, z3 "
                            f"(z2@AXES / z3@AXES for ZeRO over some data axes), joined by '+', e.g. bp+mp+sp+z3")
    use_mp, use_emb, use_ep, use_auto = ("mp" in parts, "emb" in parts, "ep" in parts, "auto" in parts)
    zero = "z3" if "z3" in parts else "z2" if "z2" in parts else None
    use_bp = "bp" in parts or zero is not None          # ZeRO is data parallelism with sharded state
    check_mesh(mesh, name, need_data=use_bp, need_model=use_mp or use_emb or use_auto or "sp" in parts)
    daxes = data_axes(mesh)
    if callable(kinds):
        kinds = tuple(kinds(cfg, mesh.axis_size(MODEL_AXIS) if MODEL_AXIS in mesh.axis_names else 1))
    shapes = _kind_shapes(param_shapes(cfg), kinds) if cfg is not None else None
    # how many devices already tile each dim of each kind
    tiled: dict[str, dict[int, int]] = {k.pattern: {} for k in kinds}
    tactics = [_expert_tactic(name, kinds, mesh, shapes, tiled)] if use_ep else []

    if use_bp:
        if cfg is not None:
            _check_batch(name, mesh, daxes, batch_size(cfg), int(cfg.get("microbatches", 1)))
        for ax in daxes:
            tactics.append(ManualPartition({p: 0 for p in batch_patterns}, axis=ax, name=f"bp:{ax}"))

    if use_mp:
        if cfg is not None and check_mp is not None:
            check_mp(cfg, mesh.axis_size(MODEL_AXIS))
        tactics.append(_model_tactic(name, "mp", kinds, mesh, shapes, tiled))
    if use_emb:
        tactics.append(_model_tactic(name, "emb", kinds, mesh, shapes, tiled))
    if "sp" in parts:
        tactics.append(_sequence_tactic(name, batch_patterns, seq_dim))
    if "pp" in parts:
        tactics.append(stage_tactic(name, kinds, mesh, cfg))
    if "cp" in parts:
        tactics.append(context_tactic(name, mesh, cfg, batch_patterns, seq_dim))
    if use_auto:
        # the model axis searched instead of written: the caller's cost model prices each choice
        # (partir_emu.api passes the analytical model, on this tactic's hardware)
        tactics.append(AutomaticPartition(MODEL_AXIS, inputs="params/*", name=f"auto:{MODEL_AXIS}",
                                          hardware="tpu-v4"))

    if zero is not None:
        tactics += _zero_tactics(zero, mesh, kinds, shapes, tiled, use_mp, use_emb, zero_axes, use_ep)
    return tactics


def _expert_tactic(name: str, kinds: Sequence[ParamKind], mesh: Mesh, shapes: dict | None,
                   tiled: dict[str, dict[int, int]]) -> ManualPartition:
    """``ep``, GShard's expert parallelism: each kind with an ``ep_dim`` (a mixture of experts' weights
    stacked [E, ...]) tiled on E over the ``expert`` axis, its ``mu``/``nu`` alike; ``tiled`` records it.

    The tactic stops at the MoE tags (:data:`EXPERT_TAGS`): the dispatched tokens [E, G, C, d] are tiled
    on E on the experts' side and keep the batch's tiling on the tokens' side, and the lowering joins
    the two with one all_to_all each way (dispatch, combine; the backward pass likewise). ``expert`` is
    also a data axis (the batch is split over it: GShard lays the experts over the data-parallel
    devices); ep comes first, so that bp on ``expert`` meets the experts' tiling at the tags rather
    than reaching the experts first (which would gather their weights)."""
    if EXPERT_AXIS not in mesh.axis_names:
        raise ScenarioError(f"strategy {name!r} needs mesh axis {EXPERT_AXIS!r}, which {mesh} lacks; add it, e.g. "
                            f"--mesh batch=2,{EXPERT_AXIS}=2 (the batch is split over it too)")
    size = mesh.axis_size(EXPERT_AXIS)
    inputs: dict[str, int] = {}
    for k in kinds:
        if k.ep_dim is None:
            continue
        bad = [s for s in (shapes[k.pattern] if shapes else []) if s[k.ep_dim] % size]
        if bad:
            raise ScenarioError(f"strategy {name!r}: the {bad[0][k.ep_dim]} experts of params/{k.pattern} are not "
                                f"divisible by axis {EXPERT_AXIS!r} of size {size}; change --set experts=... or the mesh")
        inputs[f"params/{k.pattern}"] = inputs[f"opt/*/{k.pattern}"] = k.ep_dim
        tiled[k.pattern][k.ep_dim] = size
    if not inputs:
        raise ScenarioError(f"strategy {name!r}: this model has no experts for 'ep' to shard; give it a mixture of "
                            f"experts (transformer: --set experts=8) or drop ep")
    return ManualPartition(inputs, axis=EXPERT_AXIS, name=f"ep:{EXPERT_AXIS}", stop_at=EXPERT_TAGS)


def _check_batch(name: str, mesh: Mesh, daxes: list[str], batch: int, microbatches: int) -> None:
    """The batch, and each micro-batch of gradient accumulation, splits evenly over the data axes."""
    group = mesh.group_size(daxes)
    if batch % group:
        raise ScenarioError(f"strategy {name!r}: batch {batch} is not divisible by the data "
                            f"axes {daxes} of {mesh} (product {group}); change --set batch=...")
    # gradient accumulation shards every micro-batch's rows, not the batch's: a micro-batch smaller
    # than the data group would be resharded across it on every step (silently slow), so it is
    # refused like an indivisible batch
    if microbatches > 1 and (batch // microbatches) % group:
        raise ScenarioError(f"strategy {name!r}: a micro-batch of batch {batch} / microbatches "
                            f"{microbatches} = {batch // microbatches} rows is not divisible by the data axes {daxes} "
                            f"of {mesh} (product {group}); lower --set microbatches=... or raise batch")


def _sequence_tactic(name: str, batch_patterns: Sequence[str], seq_dim: int | None) -> ManualPartition:
    """``sp`` (Megatron-SP, Korthikanti et al. 2022): the batch's sequence dim on the model axis, after
    Megatron's weights. Everything mp leaves replicated over model (norms, residual stream, dropout,
    loss) is split by sequence instead; where it meets a column-parallel matmul the input is
    all-gathered over model, where a row-parallel output meets it the partial sum is reduce-scattered
    (instead of one all-reduce). The meetings are the point: resharded, not warned about."""
    if seq_dim is None:
        raise ScenarioError(f"strategy {name!r}: sp splits the sequence, and this scenario's batch has no sequence "
                            f"dim; drop sp")
    return ManualPartition({p: seq_dim for p in batch_patterns}, axis=MODEL_AXIS, name=f"sp:{MODEL_AXIS}",
                           meet="reshard")


def _zero_axes(name: str, mesh: Mesh) -> tuple[list[str], list[str] | None]:
    """``name``'s parts with any ``@AXES`` of ``z2``/``z3`` taken off, and those axes (None: every data
    axis). ``z3@fsdp`` shards the state over ``fsdp`` only and keeps it replicated over the other data
    axes (PyTorch's hybrid sharding, MaxText's FSDP inside a slice and data parallelism across)."""
    parts, axes = [], None
    for part in name.split("+"):
        head, at, rest = part.partition("@")
        if at and head in ("z2", "z3"):
            axes = [a for a in rest.split(",") if a]
            bad = [a for a in axes if a not in data_axes(mesh)]
            if not axes or bad:
                raise ScenarioError(f"strategy {name!r}: {head}@{rest} names {bad or 'no axis'}, not data axes of "
                                    f"{mesh}; write {head}@AXIS with axes among {data_axes(mesh)}")
        parts.append(head if at and head in ("z2", "z3") else part)
    return parts, axes


def _zero_tactics(zero: str, mesh: Mesh, kinds: Sequence[ParamKind], shapes: dict | None,
                  tiled: dict[str, dict[int, int]], use_mp: bool, use_emb: bool,
                  axes: Sequence[str] | None = None, use_ep: bool = False) -> list[ManualPartition]:
    """ZeRO-2/3's tactics, one per data axis (or per axis of ``axes``, see :func:`build_strategy`);
    ``tiled`` is updated. With ``ep`` the experts' weights are already split over ``expert``: ZeRO
    leaves them alone on that axis."""
    tactics: list[ManualPartition] = []
    daxes = [a for a in data_axes(mesh) if axes is None or a in axes]
    for ax in daxes:
        size = mesh.axis_size(ax)
        inputs = {}
        for k in kinds:
            if k.rank == 0 or (use_ep and ax == EXPERT_AXIS and k.ep_dim is not None):
                continue
            d = _zero_dim(k, _model_dim(k, use_mp, use_emb), size, tiled[k.pattern],
                          shapes[k.pattern] if shapes else None)
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


def _model_dim(kind: ParamKind, use_mp: bool, use_emb: bool) -> int | None:
    """The dim of ``kind`` that the ``model`` axis tiles under this strategy, if any."""
    if use_mp and kind.mp_dim is not None:
        return kind.mp_dim
    return kind.emb_dim if use_emb else None


def _model_tactic(name: str, part: str, kinds: Sequence[ParamKind], mesh: Mesh, shapes: dict | None,
                  tiled: dict[str, dict[int, int]]) -> ManualPartition:
    """The ``model``-axis tactic of ``part`` (``mp``: each kind's ``mp_dim``; ``emb``: its ``emb_dim``),
    with the optimizer state alike; ``tiled`` records what it tiles."""
    msize = mesh.axis_size(MODEL_AXIS)
    inputs: dict[str, int] = {}
    for k in kinds:
        d = k.mp_dim if part == "mp" else k.emb_dim
        if d is None:
            continue
        bad = [s for s in (shapes[k.pattern] if shapes else []) if s[d] % msize]
        if bad:
            raise ScenarioError(f"strategy {name!r}: dim {d} of params/{k.pattern} (shape {bad[0]}) is not divisible "
                                f"by axis {MODEL_AXIS!r} of size {msize}; change the sizes or the mesh")
        inputs[f"params/{k.pattern}"] = d
        inputs[f"opt/*/{k.pattern}"] = d
        tiled[k.pattern][d] = msize
    if not inputs:
        raise ScenarioError(f"strategy {name!r}: this scenario has no parameter that {part!r} shards "
                            f"({'no embedding or unembedding table' if part == 'emb' else 'no Megatron layer'})")
    return ManualPartition(inputs, axis=MODEL_AXIS, name=f"{part}:{MODEL_AXIS}")


def _zero_dim(kind: ParamKind, model_dim: int | None, size: int, tiled: dict[int, int],
              shapes: list[tuple[int, ...]] | None) -> int | None:
    lead = 1 if kind.stacked else 0                 # a stacked kind's dim 0 is the layer dim
    if kind.rank - lead < 2:                        # a vector stacks the data axis after ``model``
        model_dim = None
    if kind.rank <= lead:
        return None
    default = lead
    if model_dim is not None:
        default = next(d for d in range(lead, kind.rank) if d != model_dim)
    if shapes is None:
        return default
    fits = lambda d: all(s[d] % (tiled.get(d, 1) * size) == 0 for s in shapes)
    if fits(default):
        return default
    candidates = [d for d in range(lead, kind.rank) if d != model_dim and fits(d)]
    if not candidates:
        return None
    return min(candidates, key=lambda d: (-min(s[d] for s in shapes), d))


STRATEGY_NAMES = ("bp", "mp", "z2", "z3", "bp+mp", "bp+mp+z2", "bp+mp+z3", "bp+auto")
# for scenarios with an embedding and an unembedding (kinds with an ``emb_dim``)
EMB_STRATEGY_NAMES = ("bp+emb", "bp+mp+emb", "bp+mp+emb+z3")


def make_strategies(kinds: Sequence[ParamKind] | KindsFn, param_shapes: Callable[[Config], dict], *,
                    check_mp: Callable[[Config, int], None] | None = None, seq_dim: int | None = None,
                    names: Sequence[str] = STRATEGY_NAMES) -> dict[str, Strategy]:
    """``{name: strategy(mesh, cfg=None) -> list[ManualPartition]}`` for the standard names; any other
    combination of the parts (``bp+z3@fsdp``) is built on request (:meth:`Strategies.compose`)."""

    def make(n: str) -> Strategy:
        def strategy(mesh: Mesh, cfg: Config | None = None) -> list[ManualPartition]:
            return build_strategy(n, mesh, cfg, kinds=kinds, param_shapes=param_shapes, check_mp=check_mp,
                                  seq_dim=seq_dim)
        strategy.__name__ = strategy.__qualname__ = f"strategy_{n.replace('+', '_').replace('@', '_at_')}"
        strategy.__doc__ = f"Strategy {n!r}: see scenarios.strategies.build_strategy."
        return strategy

    return Strategies(make, names)


class Strategies(dict):
    """The listed strategies by name, and :meth:`compose` for any other combination of the parts."""

    def __init__(self, make: Callable[[str], Strategy], names: Sequence[str]) -> None:
        super().__init__({n: make(n) for n in names})
        self._make = make

    def compose(self, name: str) -> Strategy | None:
        """The strategy ``name`` though it is not listed, if it is made of the parts (``None`` if not;
        how they combine is checked when it is built)."""
        if not name or any(p.partition("@")[0] not in PARTS for p in name.split("+")):
            return None
        return self._make(name)


