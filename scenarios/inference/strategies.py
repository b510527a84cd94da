"""The inference scenario's strategies: ``bp``, ``mp``, ``mq`` and ``bp+mp``, ``bp+mq``, ``mq+ws``.

Input names: ``params/layer_i/attn/w_q`` …, ``cache/layer_i/k`` [batch, cache_len, kv_heads,
head_dim], ``cache/pos``, ``batch/tokens`` (see :mod:`scenarios.inference.scenario`). Data axes are every
mesh axis except ``model``.

- ``bp``: the tokens and the KV cache on their batch dim (0), on each data axis.
- ``mp`` (Megatron on ``model``): ``w_q`` and the MLP's first matrices column-parallel (heads,
  ``d_ff``), ``w_o`` and the MLP's last matrix row-parallel; ``w_k``, ``w_v`` and the cache on
  the kv heads when ``kv_heads`` divides by the ``model`` axis, else replicated: with multi-query
  attention every device then holds the whole cache (Pope et al. 2022, section 3.3, Fig. 4a).
- ``mq`` (multi-query sharding, Pope et al. 2022 section 3.3, Fig. 4b; the PartIR paper's MQ
  tactic): ONE tactic on ``model`` tiling the KV cache on its batch dim and the weights as ``mp``
  (``w_k``, ``w_v`` replicated), the cache pattern written first. Queries are computed sharded
  on heads and the cache is read sharded on batch; propagation meets the two at the attention
  einsums and the lowering reshards the small operands: per layer an all_to_all of the queries
  (heads -> batch) and one of the attention output (batch -> heads); the residual stream ends
  sharded on batch (all_gather before the column-parallel matmuls, reduce_scatter after the
  row-parallel ones, the bytes of Megatron's all_reduce). Nothing gathers the cache or a weight.

  ``mq+ws`` adds Pope et al.'s 2D weight-stationary layout (section 3.2.2) on the data axes: every
  weight's d_model dim and the cache's batch dim, so the weights are spread over all chips (PaLM
  540B fits 64 v4 chips only so) and only activations move: partial sums over d_model are
  all-reduced or reduce-scattered, the queries resharded as in ``mq``.

  Why one tactic: as two tactics, the earlier one takes the whole program. Cache first: its
  batch tiling reaches the residual stream backward through the cache update (``k = x @ w_k``),
  so every weight is all-gathered where it meets it. Heads first: the queries' heads tiling wins
  at the attention einsum and the cache is all-gathered there. In one tactic every seed claims
  its neighbourhood before propagation runs on, which is the intended layout. The tactic says so
  (``meet="reshard"``): the compiler records those meetings as intended conflicts, reshards there
  and does not warn; which seed wins follows the pattern order (``tests/integration/test_inference.py`` pins
  all three outcomes).
"""
from __future__ import annotations

from partir_emu.compiler.tactics import AutomaticPartition, ManualPartition, Tactic
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.common import MODEL_AXIS, Config, Strategy
from scenarios.inference.config import PRESETS, complete_config
from scenarios.strategies import check_mesh, data_axes

CACHE = "cache/layer_*"     # every layer's k and v (not cache/pos, a scalar)


def _cfg(cfg: Config | None) -> Config:
    return complete_config(cfg if cfg is not None else PRESETS["tiny"])


def _bp(name: str, mesh: Mesh, cfg: Config | None, model_too: bool) -> list[ManualPartition]:
    daxes = data_axes(mesh)
    if cfg is not None:
        group = mesh.group_size(daxes + ([MODEL_AXIS] if model_too else []))
        if cfg["batch"] % group:
            raise ScenarioError(f"strategy {name!r}: batch {cfg['batch']} is not divisible by the axes that shard "
                                f"it ({daxes + ([MODEL_AXIS] if model_too else [])}, product {group}) of {mesh}; "
                                "change --set batch=... or the mesh")
    return [ManualPartition({"batch/tokens": 0, CACHE: 0}, axis=ax, name=f"bp:{ax}") for ax in daxes]


def _weights(name: str, mesh: Mesh, cfg: Config | None, *, kv_on_heads: bool) -> dict[str, int]:
    """Megatron's dims of the weights (and the cache on kv heads when ``kv_on_heads``)."""
    c = _cfg(cfg)
    msize = mesh.axis_size(MODEL_AXIS)
    if cfg is not None:
        for size, what in ((c["heads"], "heads"), (c["d_ff"], "d_ff")):
            if size % msize:
                raise ScenarioError(f"strategy {name!r}: {what}={size} is not divisible by the {MODEL_AXIS!r} axis "
                                    f"(size {msize}); change --set {what}=... or the mesh")
    first, last = (("w_gate", "w_up"), "w_down") if c["mlp"] == "swiglu" else (("w_in",), "w_out")
    out = {"params/layer_*/attn/w_q": 1, "params/layer_*/attn/w_o": 0, f"params/layer_*/mlp/{last}": 0}
    out.update({f"params/layer_*/mlp/{w}": 1 for w in first})
    if kv_on_heads and c["kv_heads"] % msize == 0:
        out.update({"params/layer_*/attn/w_k": 1, "params/layer_*/attn/w_v": 1, CACHE: 2})
    return out


def _ws(name: str, mesh: Mesh, cfg: Config | None) -> list[ManualPartition]:
    """Pope et al.'s 2D weight-stationary layout (section 3.2.2) on each data axis: every weight's
    d_model dim (the embedding's too), and the KV cache on its batch dim as ``mq`` has it on ``model``."""
    c = _cfg(cfg)
    daxes = data_axes(mesh)
    if cfg is not None:
        group = mesh.group_size(daxes)
        for size, what in ((c["d_model"], "d_model"), (c["batch"] // mesh.axis_size(MODEL_AXIS), "batch per model group")):
            if size % group:
                raise ScenarioError(f"strategy {name!r}: {what}={size} is not divisible by the data axes {daxes} "
                                    f"(product {group}) of {mesh}; change --set or the mesh")
    first, last = (("w_gate", "w_up"), "w_down") if c["mlp"] == "swiglu" else (("w_in",), "w_out")
    dims: dict[str, int] = {CACHE: 0, "params/layer_*/attn/w_q": 0, "params/layer_*/attn/w_k": 0,
                            "params/layer_*/attn/w_v": 0, "params/layer_*/attn/w_o": 1,
                            f"params/layer_*/mlp/{last}": 1, "params/embed/*": 1, "params/*ln*/*": 0}
    dims.update({f"params/layer_*/mlp/{w}": 0 for w in first})
    if not c["tied"]:
        dims["params/unembed/w"] = 0
    return [ManualPartition(dims, axis=ax, name=f"ws:{ax}", meet="reshard", allow_unmatched=True) for ax in daxes]


def build(name: str, mesh: Mesh, cfg: Config | None = None) -> list[Tactic]:
    """The tactics of ``name`` (module docstring): bp tactics first (one per data axis), then the
    ``model`` tactics."""
    parts = name.split("+")
    if parts == ["bp", "auto"]:     # the model axis searched over the weights and the cache
        check_mesh(mesh, name, need_data=True, need_model=True)
        return [*_bp(name, mesh, cfg, False),
                AutomaticPartition(MODEL_AXIS, inputs=("params/*", CACHE), name=f"auto:{MODEL_AXIS}")]
    if parts == ["mq", "ws"]:       # multi-query attention on model, 2D weight-stationary on the data axes
        check_mesh(mesh, name, need_data=True, need_model=True)
        return [*build("mq", mesh, cfg), *_ws(name, mesh, cfg)]
    if parts not in (["bp"], ["mp"], ["mq"], ["bp", "mp"], ["bp", "mq"]):
        raise ScenarioError(f"inference strategy {name!r} is not one of {', '.join(STRATEGY_NAMES)}")
    use_bp, use_mq = "bp" in parts, "mq" in parts
    check_mesh(mesh, name, need_data=use_bp, need_model="mp" in parts or use_mq)
    tactics = _bp(name, mesh, cfg, use_mq) if use_bp else []
    if use_mq:
        if not use_bp and cfg is not None and cfg["batch"] % mesh.axis_size(MODEL_AXIS):
            raise ScenarioError(f"strategy {name!r}: batch {cfg['batch']} is not divisible by the {MODEL_AXIS!r} "
                                f"axis (size {mesh.axis_size(MODEL_AXIS)}); change --set batch=... or the mesh")
        tactics.append(ManualPartition({CACHE: 0, **_weights(name, mesh, cfg, kv_on_heads=False)}, axis=MODEL_AXIS,
                                       name=f"mq:{MODEL_AXIS}", meet="reshard"))
    elif "mp" in parts:
        tactics.append(ManualPartition(_weights(name, mesh, cfg, kv_on_heads=True), axis=MODEL_AXIS,
                                       name=f"mp:{MODEL_AXIS}"))
    return tactics


STRATEGY_NAMES = ("bp", "mp", "mq", "bp+mp", "bp+mq", "mq+ws", "bp+auto")


def _make(n: str) -> Strategy:
    def strategy(mesh: Mesh, cfg: Config | None = None) -> list[Tactic]:
        return build(n, mesh, cfg)
    strategy.__name__ = strategy.__qualname__ = f"strategy_{n.replace('+', '_')}"
    strategy.__doc__ = f"Inference strategy {n!r}: see scenarios.inference.strategies."
    return strategy


STRATEGIES: dict[str, Strategy] = {n: _make(n) for n in STRATEGY_NAMES}

__all__ = ["STRATEGIES", "STRATEGY_NAMES", "build"]
