"""Pipeline parallelism as SPMD pipelining, plain JAX (GSPMD, Xu et al. 2021 sec. 3.3; praxis
``LayerwiseShardablePipelined``; MaxText ``layers/pipeline.py``): ``--set pipeline=P,microbatches=M``
(``virtual_stages=V`` for the circular schedule).

Nothing here names a device. The layers run as ``P`` stages side by side: every per-stage value has
a leading stage dim of size ``P``, and the strategy part ``pp`` tiles the layers' weights on the
``stage`` mesh axis; propagation carries that tiling to every per-stage value, and the one place
where stages talk, a rotation of the stage dim by one (``jnp.roll``), becomes a
``collective_permute`` between neighbouring stages (``partir_emu/compiler/lowering/rotate.py``):

- **weights**: ``params/layers/...`` stacked ``[L, ...]`` (as ``layers_as=loop``), in *stage-major*
  order: stored row ``j = (k·V + r)·lps + l`` is network layer ``(r·P + k)·lps + l`` (stage ``k``,
  repeat ``r``, layer ``l`` of ``lps = L / (P·V)``), so that a block tiling of dim 0 on ``stage``
  gives device ``k`` exactly the layers it runs (the identity for ``V = 1``; :func:`layer_order`).
  :func:`scenarios.transformer.scenario.make_params` stores the draws of ``layers_as=loop`` in that
  order, so a pipelined config computes the very function of the unpipelined one.
- **state buffer** ``shift`` ``[P, mb, seq, d]``: what each stage works on; after a tick every stage's
  output rotates one stage on (``roll(out, 1)``: the forward permute; its transpose in the backward
  pass permutes the gradients back).
- **conveyor** ``io`` ``[P, M/P, mb, seq, d]`` (MaxText's stage-sharded ``state_io``): holds the
  micro-batches (micro-batch ``a·M/P + c`` at ``[a, c]``) and, as they finish, their outputs. On each
  *injection* tick one column is visited: stage 0 takes its row as input and leaves in its place the
  finished output that the rotation just brought it from the last stage, and the column rotates one
  stage towards 0 (``roll(col, -1)``, a second permute). So inputs come in and outputs go out
  without a per-tick all-reduce or broadcast; after the loop one more visit stores the last output
  and a local roll of the column index puts output ``n`` where input ``n`` was.
- **ticks**: one ``lax.scan`` over ``T = M·V + P - 1`` ticks; in each, every stage applies its
  ``lps`` layers (a ``lax.scan`` over them of ``vmap(block)`` over the stage dim) to its micro-batch.

**Schedules.** ``V = 1`` is GPipe: micro-batch ``i`` is at stage ``k`` on tick ``i + k``; all
forward passes, then (jax's autodiff of the loop) all backward passes; bubble
``(P - 1) / (M + P - 1)``. ``V > 1`` is the circular (interleaved) schedule with Megatron's grouping
(Narayanan et al. 2021 sec. 2.2.2): device ``k`` holds the layer chunks ``k, P + k, ...``; micro-batches
enter in groups of ``P``, each group goes round the ring ``V`` times (the last stage's output wraps
to stage 0 on the next tick) before the next group enters, so every stage is busy but for
``P - 1`` ticks: bubble ``(P - 1) / (M·V + P - 1)``; each stage picks its chunk of the tick with a
gather over the repeat dim batched over the stage dim (MaxText's ``vmap_parallel_gather``).
Needs ``M`` a multiple of ``P`` (both schedules: the conveyor has ``M/P`` columns).

1F1B (PipeDream-flush) runs a micro-batch's backward pass as soon as its forward pass leaves the
last stage; here the backward pass is jax's transpose of the whole tick loop, which runs after it,
so ``schedule=1f1b`` is a step that computes its gradient itself
(:mod:`scenarios.transformer.pipeline_1f1b`), interleaved with ``virtual_stages=V``.

The embedding runs before the loop on the whole batch and the head (final norm, logits, loss)
after it, a micro-batch at a time (:func:`per_micro_batch`: one micro-batch's logits live, as on
Megatron's last stage), both replicated over ``stage`` (each stage's device computes them: the
conveyor's outputs are gathered over ``stage`` for the head, the embedding's gradient likewise;
where the data axes split a micro-batch into single rows the batch's layout lets the stages split
the head's rows instead). Megatron's last stage runs the head on every micro-batch on the
pipeline's critical path, so replicated it costs each device about what it costs Megatron's.
"""
from __future__ import annotations

import numpy as np

from partir_emu.errors import ScenarioError
from scenarios.common import Config

NAMES = ("pipeline", "virtual_stages", "schedule")    # the transformer's --set keys of this module (and 1F1B's)
_CHUNK = "pipeline_chunk"                   # the checkpoint names of a tick's gathered layer chunk
_LAYER_INPUT = "pipeline_layer_input"       # and of each layer's input


def stages(cfg: Config) -> int:
    return int(cfg.get("pipeline", 1))


def pipelined(cfg: Config) -> bool:
    return stages(cfg) > 1


def complete(cfg: Config) -> Config:
    """A pipelined config stacks its layers (``layers_as=loop``) and has ``virtual_stages`` (1); any
    other config is left as it is."""
    if not pipelined(cfg):
        return cfg
    return dict(cfg, layers_as="loop", virtual_stages=int(cfg.get("virtual_stages", 1)),
                schedule=str(cfg.get("schedule", "gpipe")))


def check(cfg: Config) -> None:
    """A pipeline that cannot be built raises :class:`ScenarioError` naming the keys."""
    if not pipelined(cfg):
        for key, default in (("virtual_stages", "1"), ("schedule", "gpipe")):
            if str(cfg.get(key, default)) != default:
                raise ScenarioError(f"transformer: {key} without pipeline; set --set pipeline=P (the stages) too")
        return
    p, v, m, layers = stages(cfg), int(cfg["virtual_stages"]), int(cfg.get("microbatches", 1)), cfg["layers"]
    if layers % (p * v):
        raise ScenarioError(f"transformer: layers={layers} is not divisible by pipeline={p} x virtual_stages={v}; "
                            "every stage runs the same number of layers")
    if cfg.get("experts"):
        raise ScenarioError("transformer: pipeline with experts is not supported (a MoE layer's auxiliary loss is not "
                            "carried through the stages); drop one of them")
    if cfg["schedule"] == "1f1b":        # checked by scenarios.transformer.pipeline_1f1b.check
        return
    if m % p:
        raise ScenarioError(f"transformer: microbatches={m} is not a multiple of pipeline={p}; the pipeline feeds its "
                            f"stages micro-batches in groups of {p} (set --set microbatches={p * max(1, m // p)})")
    if v > 1 and str(cfg.get("remat", 0)) == "selective":
        raise ScenarioError(f"transformer: virtual_stages={v} with remat=selective: a circular tick is checkpointed to "
                            "gather its layer chunk again in the backward pass, and inside it jax keeps what the "
                            "attention core's own checkpoint would recompute; use remat=1, minimal, dots, op or 0")


def layer_order(cfg: Config) -> np.ndarray:
    """``order[j]``: the network layer stored at row ``j`` of ``params/layers`` (stage-major, see the
    module docstring)."""
    p, v = stages(cfg), int(cfg.get("virtual_stages", 1))
    lps = cfg["layers"] // (p * v)
    stage, repeat, layer = np.meshgrid(np.arange(p), np.arange(v), np.arange(lps), indexing="ij")
    return ((repeat * p + stage) * lps + layer).reshape(-1)


def ticks(cfg: Config) -> int:
    """``M·V + P - 1``: the loop's length (GPipe, circular; 1F1B's three loops have ``M + 2P - 2``)."""
    return int(cfg["microbatches"]) * int(cfg.get("virtual_stages", 1)) + stages(cfg) - 1


def run_layers(cfg: Config, block, layers: dict, x, policy=None):
    """The layers of the model on ``x`` [batch, seq, d] as a pipeline (see the module docstring);
    ``block(h, p) -> h`` is one layer, wrapped here in ``jax.checkpoint`` with the ``remat`` config's
    ``policy`` (None: not wrapped) as the unpipelined model wraps it, but for the stage dim the
    layers are vmapped over (:func:`_per_stage`); ``layers`` is the stacked ``params/layers`` tree."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    p, v, m = stages(cfg), int(cfg["virtual_stages"]), int(cfg["microbatches"])
    if policy is not None:
        policy = _per_stage(policy)
        block = jax.checkpoint(block, policy=policy)
    lps, q, mb = cfg["layers"] // (p * v), m // p, x.shape[0] // m
    rest = x.shape[1:]
    # micro-batch i holds rows i, m + i, ... (a batch tiling of the rows stays on every micro-batch)
    io = jnp.swapaxes(x.reshape(mb, m, *rest), 0, 1).reshape(p, q, mb, *rest)
    # [L, ...] stage-major -> [V, lps, P, ...]: a chunk's layers, each with the stage dim in front of the layer's own
    # (GPipe: the one chunk [lps, P, ...], taken once, not every tick)
    w = jax.tree.map(lambda a: jnp.moveaxis(a.reshape(p, v, lps, *a.shape[1:]), 0, 2), layers)
    if v == 1:
        w = jax.tree.map(lambda a: a[0], w)
    stage_ids = jnp.arange(p, dtype=jnp.int32)
    first = (stage_ids == 0).reshape(p, *(1,) * (1 + len(rest)))

    def run_stages(w_t, h):           # every stage's lps layers on its micro-batch h [P, mb, ...]
        def layer(c, w_l):
            return jax.vmap(block)(checkpoint_name(c, _LAYER_INPUT), w_l), None
        return jax.lax.scan(layer, h, w_t)[0]

    def chunk_and_run(w, repeat, h):
        return run_stages(_chunks(w, v, repeat), h)

    if v > 1:
        chunk_and_run = jax.checkpoint(chunk_and_run, policy=_tick_policy(policy))

    def visit(io, shift, t):
        """The conveyor at tick ``t``: stage 0's input candidate, and the column after the visit."""
        period = p * v
        u = t % period
        k = (t // period) * p + jnp.minimum(u, p - 1)          # the injection this tick is (u < P)
        col = jax.lax.dynamic_index_in_dim(io, k % q, axis=1, keepdims=False)
        moved = jnp.roll(jnp.where(first, shift, col), -1, axis=0)
        if v > 1:
            moved = jnp.where(u < p, moved, col)
        return col, u < p, jax.lax.dynamic_update_index_in_dim(io, moved, k % q, axis=1)

    def tick(carry, t):
        shift, io = carry
        col, inject, io = visit(io, shift, t)
        h = jnp.where(first & inject, col, shift)
        out = chunk_and_run(w, (t - stage_ids) % (p * v) // p, h)
        return (jnp.roll(out, 1, axis=0), io), None

    shift = jnp.zeros((p, mb, *rest), x.dtype)
    (shift, io), _ = jax.lax.scan(tick, (shift, io), jnp.arange(ticks(cfg), dtype=jnp.int32))
    _, _, io = visit(io, shift, jnp.int32(ticks(cfg)))       # the last micro-batch's output
    io = jnp.roll(io, -p, axis=1) if p % q else io             # output n where input n was
    return jnp.swapaxes(io.reshape(m, mb, *rest), 0, 1).reshape(x.shape)


def per_micro_batch(cfg: Config, fn, x, targets):
    """The mean over the micro-batches of ``fn(x_i, targets_i)`` (a mean loss of rows), one micro-batch at
    a time (a ``lax.scan`` of ``fn`` under ``jax.checkpoint``, recomputed in the backward pass): the head
    after the pipeline keeps one micro-batch's logits live, as the last stage of Megatron's pipeline
    does, not the whole batch's. Micro-batch ``i`` holds rows ``i, M + i, ...``
    as in :func:`run_layers`; the mean of the ``M`` equal micro-batches' means is the batch's."""
    import jax
    import jax.numpy as jnp

    m = int(cfg["microbatches"])
    mb = x.shape[0] // m

    def split(a):
        return jnp.swapaxes(a.reshape(mb, m, *a.shape[1:]), 0, 1)

    zero = jnp.zeros((), jax.eval_shape(fn, x[:mb], targets[:mb]).dtype)
    # recomputed in the backward pass: the loop would otherwise keep every micro-batch's logits
    fn = jax.checkpoint(fn)
    total, _ = jax.lax.scan(lambda acc, xt: (acc + fn(*xt), None), zero, (split(x), split(targets)))
    return total / m


def _per_stage(policy):
    """``policy`` as it judges one stage's equations: vmapping a layer over the stage dim gives each of
    its dots a leading batch dim, which a policy on dots' batch dims (``remat=minimal``'s
    ``checkpoint_dots_with_no_batch_dims``) must not count, or it would save no projection at all."""
    def per_stage(prim, *avals, **params):
        if prim.name == "dot_general":
            (lc, rc), (lb, rb) = params["dimension_numbers"]
            if tuple(lb[:1]) == tuple(rb[:1]) == (0,):
                params = {**params, "dimension_numbers": ((lc, rc), (tuple(lb[1:]), tuple(rb[1:])))}
        return policy(prim, *avals, **params)

    return per_stage


def _tick_policy(policy):
    """What a circular tick saves for the backward pass: what the layers' ``remat`` policy saves, and
    each layer's input (MaxText's pipeline remat policy), never the tick's gathered chunk, which is
    gathered again (kept, the chunk of every tick would be ``V·T/P`` copies of the stage's weights);
    without a policy (``remat=0``) everything else."""
    import jax

    policies = jax.checkpoint_policies
    if policy is None:
        return policies.save_anything_except_these_names(_CHUNK)
    return policies.save_from_both_policies(policy, policies.save_only_these_names(_LAYER_INPUT))


def _chunks(w: dict, v: int, repeat):
    """Each stage's layer chunk of this tick: ``w`` leaves [V, lps, P, ...] -> [lps, P, ...], stage ``k``
    taking repeat ``repeat[k]`` (:func:`per_stage_index`; its transpose accumulates into the chunk in
    place, ``partir_emu/compiler/tracing/idioms.py``). GPipe's one chunk (``V = 1``) is ``w`` itself."""
    import jax
    from jax.ad_checkpoint import checkpoint_name

    if v == 1:
        return w
    return jax.tree.map(lambda a: checkpoint_name(per_stage_index(a, repeat), _CHUNK), w)


def per_stage_index(a, index, stage_dim: int = 2):
    """``a`` [N, ..., P (at ``stage_dim``), ...] without dim 0, stage ``k`` taking row ``index[k]`` of dim 0:
    a gather over dim 0 batched over the stage dim (MaxText's ``vmap_parallel_gather``), no copy of
    the other rows. GPipe's circular chunks are [V, lps, P, ...] and 1F1B's stash [S, lps, P, ...] (slot,
    layer, stage): ``stage_dim=2`` both."""
    from jax import lax

    dn = lax.GatherDimensionNumbers(offset_dims=tuple(i for i in range(a.ndim - 1) if i != stage_dim - 1),
                                    collapsed_slice_dims=(0,), start_index_map=(0,),
                                    operand_batching_dims=(stage_dim,), start_indices_batching_dims=(0,))
    sizes = (1, *a.shape[1:stage_dim], 1, *a.shape[stage_dim + 1:])
    return lax.gather(a, index.reshape(-1, 1), dn, sizes, mode=lax.GatherScatterMode.CLIP)


def per_stage_add(a, index, update, stage_dim: int = 2):
    """``a`` with ``update`` (``a`` without dim 0) added at row ``index[k]`` of dim 0 for stage ``k``:
    :func:`per_stage_index`'s transpose, into ``a`` (a scatter-add batched over the stage dim), so an
    accumulator carried by a tick loop is updated in place, row by row."""
    from jax import lax

    dn = lax.ScatterDimensionNumbers(update_window_dims=tuple(i for i in range(a.ndim - 1) if i != stage_dim - 1),
                                     inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,),
                                     operand_batching_dims=(stage_dim,), scatter_indices_batching_dims=(0,))
    return lax.scatter_add(a, index.reshape(-1, 1), update, dn, mode=lax.GatherScatterMode.CLIP)


__all__ = ["NAMES", "check", "complete", "layer_order", "per_micro_batch", "per_stage_add", "per_stage_index",
           "pipelined", "run_layers", "stages", "ticks"]
