"""The 1F1B pipeline schedule (PipeDream-flush, Narayanan et al. 2021 sec. 2.2.1; Megatron-LM's
default) and its interleaved form (sec. 2.2.2), as SPMD pipelining in plain JAX:
``--set pipeline=P,microbatches=M,schedule=1f1b`` (``virtual_stages=V`` interleaved).

GPipe (:mod:`scenarios.transformer.pipeline`) is a forward tick loop that jax differentiates, so
every micro-batch's saved activations are live when the backward pass starts. 1F1B starts a
micro-batch's backward pass as soon as its forward pass has left the last stage, so the step
cannot be ``jax.grad`` of a loop: this module writes the step's gradient itself, tick loops that run
a forward unit and a backward unit on every stage, each unit a layer chunk (``lpc = L / (P·V)``
layers) on one micro-batch, the backward one through ``jax.vjp`` of each layer.

**Ticks** (:mod:`scenarios.transformer.pipeline_ticks`). With ``V = 1`` stage ``k`` runs the forward
pass of micro-batch ``i`` on tick ``i + k`` and its backward pass on tick ``i + 2P - 2 - k`` (the last
stage: the same tick, after the head), in three loops: warm-up (``P - 1`` ticks of forward units),
steady (``M`` ticks of forward unit, head, backward unit), cool-down (``P - 1`` ticks of backward
units). Interleaved, device ``k`` holds chunks ``k, P + k, ...`` and micro-batches go round the ring
``V`` times in groups of ``P`` (Megatron's grouping; ``M`` a multiple of ``P``); the head runs on the
ticks the last device runs the last chunk, so the steady ticks split into loops with and without it.
Either way a stage runs ``VM + P - 1`` forward and as many backward units of ``1/V`` of its layers,
``P - 1`` of each idle: the bubble ``(P - 1) / (VM + P - 1)``, Megatron's. Between ticks the forward
outputs rotate one stage on (``roll(+1)``, the last stage's to stage 0) and the input gradients one
stage back (``roll(-1)``): two ``collective_permute`` s on the ``stage`` axis a tick.

**Memory.** Activation recompute is Megatron's full recompute (``remat=1``): a forward unit keeps
each of its layers' inputs (the stash), the backward unit recomputes each layer from its input under
``jax.vjp`` and runs its backward pass, one layer's activations live at a time. The stash has
``2PV - 1`` slots written by tick (stage ``k`` holds a unit ``2P(V - c) - 2(k + 1) + 1`` ticks);
Megatron's stage 0 holds ``P`` units (``2(P - 1) + (V - 1)P + 1`` interleaved): lock-step ticks move
a micro-batch one stage a tick both ways, where Megatron's stages run at their own pace. A stack that
runs stages as their own programs prices the slots Megatron holds (:func:`program_meta`,
``partir_emu.hwmodels.ring_buffers``). It does not grow with ``M``, where GPipe's does.

**Embedding and head.** Every device embeds the micro-batch stage 0 takes each tick (a gather) and
runs the head on its stage's output on the head's ticks (only the last stage's counts: each device
pays one head, as Megatron's last stage does on the critical path), and back-propagates both with a
zero cotangent where its stage is not the one that counts. Their parameter gradients are kept per
stage and summed over ``stage`` once after the loops (an all-reduce of the head's and embedding's
weight gradients, which Megatron does between its first and last stages for a tied embedding).

**Precision.** The projections' weights and biases are cast to the compute dtype once, before the
loops (Megatron keeps bf16 copies of its float32 master weights for the step), not in every unit:
the bf16 gradients are widened into float32 sums, what jax's transpose of the cast does.

Micro-batch ``i`` holds rows ``i, M + i, ...`` (a batch tiling of the rows stays on every micro-batch,
as in :func:`scenarios.training.train_step`); the loss is the mean of the micro-batches' mean losses.
Supported: ``remat=1``; interleaving with ``M`` a multiple of ``P``; anything else is refused by
:func:`check`.
"""
from __future__ import annotations

from partir_emu.errors import ScenarioError
from scenarios.common import Config
from scenarios.precision import as_dtype, compute_dtype
from scenarios.transformer.pipeline import per_stage_add, per_stage_index, pipelined, stages
from scenarios.transformer.pipeline_ticks import Phase, Units, held, phases, slots, virtual


def one_f_one_b(cfg: Config) -> bool:
    return str(cfg.get("schedule", "gpipe")) == "1f1b"


def check(cfg: Config) -> None:
    """A 1F1B config this module cannot build raises :class:`ScenarioError` naming what it lacks."""
    if not (pipelined(cfg) and one_f_one_b(cfg)):
        return
    reasons = []
    p, v, m = stages(cfg), virtual(cfg), int(cfg.get("microbatches", 1))
    if v > 1 and m % p:
        reasons.append(f"virtual_stages={v} with microbatches={m}, not a multiple of pipeline={p} (interleaved "
                       f"micro-batches go round in groups of {p}, as Megatron's; set --set microbatches="
                       f"{p * max(1, m // p)})")
    if str(cfg.get("remat", 0)) not in ("1", "full"):
        reasons.append(f"remat={cfg.get('remat', 0)} (1F1B here recomputes each layer from its stashed input, "
                       "Megatron's full recompute: set remat=1)")
    if str(cfg.get("precision", "f32")) == "fp8":
        reasons.append("precision=fp8 (its amax histories are updated by the FP8 training step, not by the 1F1B "
                       "step; use precision=bf16)")
    if reasons:
        raise ScenarioError("transformer: schedule=1f1b does not support " + "; ".join(reasons))


def program_meta(cfg: Config) -> dict:
    """What the lowered program's ``meta`` says of a 1F1B step: its stash is a ring buffer
    ([2PV - 1, lpc, P, mb, seq, d], slots on dim 0) of which an MPMD stage 0 holds
    :func:`~scenarios.transformer.pipeline_ticks.held` slots (``partir_emu.hwmodels.ring_buffers``);
    nothing for another step."""
    if not (pipelined(cfg) and one_f_one_b(cfg)):
        return {}
    dtype = "bfloat16" if cfg.get("precision", "f32") in ("bf16", "fp8") else "float32"
    return {"ring_buffers": [{"what": "1F1B stash", "ndim": 6, "slots_dim": 0, "slots": slots(cfg),
                              "held": held(cfg), "dtype": dtype}]}


def make_value_and_grad(cfg: Config, embed, block, head):
    """``(params, batch) -> (loss, grads)`` by the 1F1B schedule (module docstring). ``embed(rest,
    tokens) -> x`` [batch, seq, d]; ``block(h, w) -> h`` one layer; ``head(rest, x, targets) -> mean
    loss`` of ``x``'s rows; ``rest`` is every parameter but ``layers`` (stacked [L, ...], stage-major)."""
    def value_and_grad(params, batch):
        return _Step(cfg, embed, block, head, params, batch).run()

    return value_and_grad


class _Step:
    """One 1F1B step's tick loops over ``params`` and ``batch`` (traced once, under jax)."""

    def __init__(self, cfg: Config, embed, block, head, params: dict, batch: dict) -> None:
        import jax
        import jax.numpy as jnp

        self.cfg, self.units = cfg, Units(cfg)
        self.embed, self.head, self.layer = embed, head, jax.vmap(block)    # a layer on every stage's micro-batch
        self.p, self.v, self.m = p, v, m = stages(cfg), virtual(cfg), int(cfg["microbatches"])
        self.lpc = lpc = cfg["layers"] // (p * v)
        self.stage_ids = jnp.arange(p, dtype=jnp.int32)
        # the parameters the head and the embedding read, as paths: each part accumulates its own gradients
        # (one carry for both would add a replicated zero, e.g. the head's of embed/pos, to a pending sum);
        # only what a part reads (a tied head reads embed/tokens, not embed/pos: the [P, seq, d] float32
        # zeros of a pos gradient it never has would stay replicated over `stage`, 12.5 GiB at 1 T)
        unembed = ("embed", "tokens") if int(cfg.get("tied", 0)) else ("unembed",)
        self.parts = {"head": (("final_ln",), unembed), "embed": (("embed",),)}
        self.rest = {k: v for k, v in params.items() if k != "layers"}
        self.mb = mb = batch["tokens"].shape[0] // m

        def split(a):                           # [B, ...] -> [M, B/M, ...]: micro-batch i = rows i, M + i, ...
            return jnp.swapaxes(a.reshape(mb, m, *a.shape[1:]), 0, 1)

        self.tokens, self.targets = split(batch["tokens"]), split(batch["targets"])
        x0 = jax.eval_shape(embed, self.rest, self.tokens[0])
        self.act, self.dtype = x0.shape[1:], x0.dtype
        self.loss_type = jax.eval_shape(head, self.rest, x0, self.targets[0]).dtype

        # [L, ...] stage-major -> [lpc, P, ...] (V = 1) or [V, lpc, P, ...]: a stage's chunks and layers,
        # the stage dim after them; the projections' weights and biases in the compute dtype once a step
        # (Megatron keeps bf16 copies of the float32 master weights), not again in every tick's units;
        # the norms' stay float32
        def stacked(a):
            return jnp.moveaxis(a.reshape(p, lpc, *a.shape[1:]), 0, 1) if v == 1 else \
                jnp.moveaxis(a.reshape(p, v, lpc, *a.shape[1:]), 0, 2)

        w = jax.tree.map(stacked, params["layers"])
        self.w = jax.tree_util.tree_map_with_path(
            lambda path, a: a if str(path[0].key).startswith("ln") else as_dtype(a, compute_dtype(cfg)), w)
        self.w_dtypes = jax.tree.map(lambda a: a.dtype, w)

    def part(self, name: str, params: dict | None = None) -> dict:
        """The parameters part ``name`` reads (of ``params``, default the step's but the layers), as a
        nested dict of its paths."""
        out: dict = {}
        for path in self.parts[name]:
            node, tree = out, self.rest if params is None else params
            for key in path[:-1]:
                node, tree = node.setdefault(key, {}), tree[key]
            node[path[-1]] = tree[path[-1]]
        return out

    def with_part(self, r: dict, base: dict | None = None) -> dict:
        """``base`` (the parameters but the layers) with the leaves of a part's nested dict ``r`` in."""
        base = self.rest if base is None else base
        return {k: self.with_part(v, base[k]) if isinstance(v, dict) else v for k, v in {**base, **r}.items()} \
            if r else base

    def on(self, ok):                           # a [P] predicate against [P, mb, seq, d] values
        return ok.reshape(self.p, 1, *(1,) * len(self.act))

    def chunk(self, index):
        """Each stage's layer chunk ``index[k]`` ([lpc, P, ...]; all its layers when ``V = 1``)."""
        import jax

        return self.w if self.v == 1 else jax.tree.map(lambda a: per_stage_index(a, index, stage_dim=2), self.w)

    def micro_batch(self, a, j):
        import jax.numpy as jnp
        from jax import lax

        return lax.dynamic_index_in_dim(a, jnp.clip(j, 0, self.m - 1), keepdims=False)

    def forward(self, c: dict, t):
        """Every stage's forward unit; stage 0's input on its chunk 0 is the embedded micro-batch (on
        every device: a gather), found from ``t`` alone (a stage's unit read from stage 0's device would
        be a transfer); the inputs go to the stash."""
        import jax.numpy as jnp
        from jax import lax

        chunk, _, _ = self.units.forward(t, self.stage_ids)
        first, j0, _ = self.units.forward(t, 0)
        x_t = self.embed(self.rest, self.micro_batch(self.tokens, j0))
        h = jnp.where(self.on((self.stage_ids == 0) & (first == 0)), x_t[None], c["shift"])
        out, inputs = lax.scan(lambda h, w_l: (self.layer(h, w_l), h), h, self.chunk(chunk))
        stash = lax.dynamic_update_index_in_dim(c["stash"], inputs, t % self.units.n_slots, axis=0)
        return dict(c, shift=jnp.roll(out, 1, axis=0), stash=stash), out

    def head_unit(self, c: dict, t, out):
        """The head on every stage's output; the last stage's (on its last chunk) counts: the others'
        cotangent is zero, so their gradients are exact zeros and the sums stay plain sums (a masked sum
        would keep the data-parallel reduction of every tick's gradient in the loop)."""
        import jax
        import jax.numpy as jnp

        p = self.p
        last, j, ok = self.units.forward(t, p - 1)
        tgt = self.micro_batch(self.targets, j)
        ct = jnp.where((self.stage_ids == p - 1) & (last == self.v - 1) & ok, 1.0 / self.m, 0.0).astype(self.loss_type)

        def one(out_k, ct_k):
            loss, vjp = jax.vjp(lambda r, o: self.head(self.with_part(r), o, tgt), self.part("head"), out_k)
            return loss * ct_k, vjp(ct_k)

        loss, (d_head, d_out) = jax.vmap(one)(out, ct)
        return dict(c, loss=c["loss"] + loss), d_head, d_out

    def backward(self, c: dict, t, d_out=None, d_head=None) -> dict:
        """Every stage's backward unit, from its stashed inputs (:class:`Units`)."""
        import jax
        import jax.numpy as jnp
        from jax import lax

        p, ids = self.p, self.stage_ids
        chunk, _, ok, slot = self.units.backward(t, ids)
        g = c["grad"] if d_out is None else jnp.where(self.on((ids == p - 1) & (chunk == self.v - 1)), d_out, c["grad"])
        # an idle stage back-propagates a zero cotangent: exact zero gradients from finite stash values,
        # so the weight gradients are plain sums the lowering reduces once after the loops
        g = jnp.where(self.on(ok), g, jnp.zeros_like(g))

        def back(g, xs_l):                      # one layer, recomputed from its input, then its vjp
            w_l, x_l = xs_l
            return jax.vjp(self.layer, x_l, w_l)[1](g)

        # each stage's slot, all its chunk's layers' inputs ([lpc, P, mb, seq, d]): one gather, not a scan
        # over the layers' rows of every slot (a row of the stash per layer would be a 2PV - 1 slot copy)
        dh, dw = lax.scan(back, g, (self.chunk(chunk), per_stage_index(c["stash"], slot, stage_dim=2)), reverse=True)
        # stage 0's input gradient on its chunk 0 is the embedding's (its tokens found from t alone); the
        # other stages' cotangent is zero
        first, j0, _, _ = self.units.backward(t, 0)
        tok = self.micro_batch(self.tokens, j0)
        d_emb = jax.vmap(lambda g: jax.vjp(lambda r: self.embed(self.with_part(r), tok), self.part("embed"))[1](g)[0])(
            jnp.where(self.on((ids == 0) & (first == 0)), dh, jnp.zeros_like(dh)))
        if self.v == 1:
            d_w = jax.tree.map(lambda a, g: a + as_dtype(g, a.dtype), c["d_w"], dw)
        else:                                   # into each stage's row of its chunk (a scatter-add)
            d_w = jax.tree.map(lambda a, g: per_stage_add(a, chunk, as_dtype(g, a.dtype), stage_dim=2), c["d_w"], dw)
        c = dict(c, grad=jnp.roll(dh, -1, axis=0), d_w=d_w, d_embed=jax.tree.map(jnp.add, c["d_embed"], d_emb))
        if d_head is not None:
            c["d_head"] = jax.tree.map(jnp.add, c["d_head"], d_head)
        return c

    def tick(self, phase: Phase):
        """One tick of ``phase``'s loop: its forward units, the head, its backward units."""
        def run(c: dict, t):
            out = d_out = d_head = None
            if phase.forward:
                c, out = self.forward(c, t)
            if phase.head:
                c, d_head, d_out = self.head_unit(c, t, out)
            if phase.backward:
                c = self.backward(c, t, d_out, d_head)
            return c, None
        return run

    def run(self):
        import jax
        import jax.numpy as jnp
        from jax import lax

        p = self.p
        zeros = jnp.zeros((p, self.mb, *self.act), self.dtype)
        carry = dict(shift=zeros, grad=zeros, loss=jnp.zeros((p,), self.loss_type),
                     stash=jnp.zeros((self.units.n_slots, self.lpc, p, self.mb, *self.act), self.dtype),
                     d_w=jax.tree.map(lambda a, t: jnp.zeros(a.shape, t), self.w, self.w_dtypes),
                     **{f"d_{k}": jax.tree.map(lambda a: jnp.zeros((p, *a.shape), a.dtype), self.part(k))
                        for k in self.parts})
        for phase in phases(self.cfg):
            ticks = jnp.arange(phase.start, phase.start + phase.ticks, dtype=jnp.int32)
            carry = lax.scan(self.tick(phase), carry, ticks)[0]
        grads = {k: jax.tree.map(jnp.zeros_like, v) for k, v in self.rest.items()}
        for k in self.parts:
            grads = self.with_part(jax.tree.map(lambda g, a: g + a.sum(axis=0), self.part(k, grads), carry[f"d_{k}"]),
                                   grads)
        stage_dim = 1 if self.v == 1 else 2     # [(V,) lpc, P, ...] -> [L, ...] stage-major
        grads["layers"] = jax.tree.map(lambda a: jnp.moveaxis(a, stage_dim, 0).reshape(-1, *a.shape[stage_dim + 1:]),
                                       carry["d_w"])
        return carry["loss"].sum(), grads


__all__ = ["check", "make_value_and_grad", "one_f_one_b", "program_meta"]
