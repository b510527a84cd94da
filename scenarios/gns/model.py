"""The ``gns`` scenario's model, plain JAX: the Encode-Process-Decode graph network of a Graph Network
Simulator (Sanchez-Gonzalez et al. 2020, arXiv 2002.09405; DeepMind's reference
``learning_to_simulate/graph_network.py``) and its one-step MSE loss. Sizes, presets and
strategies are in :mod:`scenarios.gns.scenario`.

Every array carries a leading batch-of-graphs dim ``G``; one graph's message passing is written
for a single graph and ``jax.vmap``-ed over ``G``, so that the edge gathers and the node
aggregation are a gather and a scatter-add with a *batching* dim (the graph), not an offset into
one concatenated graph: tiling ``G`` (``bp``) then needs no index arithmetic and no collective.
"""
from __future__ import annotations

import numpy as np

from scenarios.common import Config
from scenarios.training import init_params, train_step

EPS = 1e-5             # LayerNorm epsilon (Sonnet's snt.LayerNorm default)


# -- parameters --------------------------------------------------------------------------------

def mlp_shapes(d_in: int, hidden: int, layers: int, d_out: int, norm: bool) -> dict:
    """``layers`` hidden linears of width ``hidden`` (ReLU), an output linear to ``d_out``, and (``norm``)
    a LayerNorm: Sonnet's ``snt.nets.MLP([hidden] * layers + [d_out])`` (+ ``snt.LayerNorm``)."""
    widths = [d_in] + [hidden] * layers + [d_out]
    out: dict = {f"layer_{i}": {"w": (a, b), "b": (b,)} for i, (a, b) in enumerate(zip(widths, widths[1:]))}
    if norm:
        out["norm"] = {"scale": (d_out,), "bias": (d_out,)}
    return out


def param_shapes(cfg: Config) -> dict:
    h, L = cfg["latent"], cfg["mlp_layers"]
    shapes: dict = {"encoder": {"node": mlp_shapes(cfg["node_in"], h, L, h, True),
                                "edge": mlp_shapes(cfg["edge_in"], h, L, h, True)}}
    for k in range(cfg["steps"]):
        # InteractionNetwork: edge MLP on [edge, sender, receiver], node MLP on [node, sum of messages]
        shapes[f"step_{k}"] = {"edge": mlp_shapes(3 * h, h, L, h, True), "node": mlp_shapes(2 * h, h, L, h, True)}
    shapes["decoder"] = mlp_shapes(h, h, L, cfg["dim"], False)
    return shapes


def make_params(cfg: Config, rng: np.random.Generator) -> dict:
    """Weights ~ N(0, 1/fan_in), biases and norm biases 0, norm scales 1."""
    return init_params(param_shapes(cfg), rng)


# -- the graphs --------------------------------------------------------------------------------

def batch_shapes(cfg: Config) -> dict:
    g, n, e = cfg["graphs"], cfg["nodes"], cfg["edges"]
    return {"nodes": ((g, n, cfg["node_in"]), np.float32), "edges": ((g, e, cfg["edge_in"]), np.float32),
            "senders": ((g, e), np.int32), "receivers": ((g, e), np.int32),
            "targets": ((g, n, cfg["dim"]), np.float32)}


def random_graph(nodes: int, edges: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(senders, receivers)`` of ``edges`` directed edges: every node sends one edge and receives one
    (needs ``edges >= 2 * nodes``), the rest uniform; the edge order is shuffled so that a block of
    edges (``edge`` strategy) mixes receivers from the whole graph, as a radius graph's edge list does."""
    senders = rng.integers(0, nodes, size=edges)
    receivers = rng.integers(0, nodes, size=edges)
    receivers[:nodes] = np.arange(nodes)
    senders[nodes:2 * nodes] = np.arange(nodes)
    order = rng.permutation(edges)
    return senders[order].astype(np.int32), receivers[order].astype(np.int32)


def make_batch(cfg: Config, rng: np.random.Generator) -> dict:
    shapes = batch_shapes(cfg)
    graphs = [random_graph(cfg["nodes"], cfg["edges"], rng) for _ in range(cfg["graphs"])]
    return {"nodes": rng.standard_normal(shapes["nodes"][0]).astype(np.float32),
            "edges": rng.standard_normal(shapes["edges"][0]).astype(np.float32),
            "senders": np.stack([s for s, _ in graphs]), "receivers": np.stack([r for _, r in graphs]),
            "targets": rng.standard_normal(shapes["targets"][0]).astype(np.float32)}


# -- the model ---------------------------------------------------------------------------------

def layer_norm(x, p: dict):
    import jax
    import jax.numpy as jnp

    mean = jnp.mean(x, axis=-1, keepdims=True)
    xc = x - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    return xc * jax.lax.rsqrt(var + EPS) * p["scale"] + p["bias"]


def mlp(x, p: dict):
    """ReLU between the linears, none after the last; then the LayerNorm if ``p`` has one."""
    import jax

    n = sum(k.startswith("layer_") for k in p)
    for i in range(n):
        x = x @ p[f"layer_{i}"]["w"] + p[f"layer_{i}"]["b"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return layer_norm(x, p["norm"]) if "norm" in p else x


def _gather(table, idx):
    """Rows ``table[idx]`` of each graph: a gather whose graph dim is a batching dim."""
    import jax

    return jax.vmap(lambda t, i: t[i])(table, idx)


def _aggregate(messages, receivers, nodes: int):
    """Sum of each node's incoming messages (``unsorted_segment_sum``): a scatter-add per graph."""
    import jax
    import jax.numpy as jnp

    def one(m, r):
        return jnp.zeros((nodes, m.shape[-1]), m.dtype).at[r].add(m)

    return jax.vmap(one)(messages, receivers)


def forward(params: dict, batch: dict, steps: int):
    """Predicted (normalised) accelerations [G, N, dim]."""
    import jax.numpy as jnp

    nodes = mlp(batch["nodes"], params["encoder"]["node"])
    edges = mlp(batch["edges"], params["encoder"]["edge"])
    r, n = batch["receivers"], nodes.shape[1]
    # both endpoints in one gather [G, E, 2, latent]: its gradient is then one scatter-add, so
    # under ``edge`` the backward resolves one pending sum per step, not one per endpoint
    ends = jnp.stack([batch["senders"], r], axis=-1)
    g, e = edges.shape[:2]
    for k in range(steps):
        p = params[f"step_{k}"]
        pair = _gather(nodes, ends).reshape(g, e, 2 * nodes.shape[-1])          # [x_sender, x_receiver]
        msg = mlp(jnp.concatenate([edges, pair], axis=-1), p["edge"])
        upd = mlp(jnp.concatenate([nodes, _aggregate(msg, r, n)], axis=-1), p["node"])
        nodes, edges = nodes + upd, edges + msg            # the residuals of _process_step
    return mlp(nodes, params["decoder"])


def make_step(cfg: Config, *, lr: float = 1e-3, grads_only: bool = False):
    """The training step ``(params, opt, batch) -> (loss, new_params, new_opt)``; with ``grads_only``
    the same step stopped before the optimizer: ``-> (loss, grads)``."""
    import jax.numpy as jnp

    steps = cfg["steps"]

    def loss_fn(params, batch):
        err = forward(params, batch, steps) - batch["targets"]
        return jnp.mean(err * err)

    return train_step(loss_fn, lr=lr, grads_only=grads_only)
