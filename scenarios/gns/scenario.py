"""A Graph Network Simulator training step (Sanchez-Gonzalez et al. 2020, "Learning to Simulate Complex
Physics with Graph Networks", arXiv 2002.09405), plain JAX; the model lives in ``scenarios.gns.model``.

The model is the paper's Encode-Process-Decode graph network (DeepMind's reference
``learning_to_simulate/graph_network.py``), on ``graphs`` graphs of ``nodes`` particles and ``edges``
directed edges each::

    x = LN(MLP_node_enc(node features))          [G, N, latent]
    e = LN(MLP_edge_enc(edge features))          [G, E, latent]
    steps × (InteractionNetwork, unshared parameters, with residuals):
        m = LN(MLP_edge([e, x[senders], x[receivers]]))          the edge update (gathers)
        u = LN(MLP_node([x, scatter_add(m at receivers)]))       the node update (scatter-add)
        x, e = x + u, e + m
    acc = MLP_dec(x)                             [G, N, dim], no LayerNorm

Every MLP is ``mlp_layers`` ReLU linears of width ``latent`` and an output linear (Sonnet's
``snt.nets.MLP``). Loss: ``mean((acc - targets)²)`` over ``batch/targets`` [G, N, dim] (the
normalised next-step accelerations); Adam as ``scenarios.common.train_step``. The batch holds
the graphs: ``nodes`` [G, N, node_in], ``edges`` [G, E, edge_in], ``senders``/``receivers``
[G, E] int32, ``targets``; random graphs (fixed seed) in which every node sends and receives at
least one edge (``edges >= 2 * nodes``). The reference builds node features (velocities,
boundary distances, a particle-type embedding) and edge features (displacement, distance) from
positions; here they are inputs, and the type embedding is taken as part of the node features.

**Sizes** (``--set`` names): ``graphs`` (the batch of graphs), ``nodes``, ``edges`` (per graph),
``latent`` (node/edge latent and MLP hidden width), ``mlp_layers`` (hidden layers per MLP),
``steps`` (message-passing steps), ``node_in``, ``edge_in``, ``dim`` (the acceleration's).

Presets: ``tiny`` (emulation) and the simulation-only ``full`` and ``xl``. Both use the model
of the reference code (``train.py``: ``latent_size=128``, ``hidden_size=128``, ``hidden_layers=2``,
``message_passing_steps=10``, ``batch_size=2`` graphs) and its feature widths (``model_demo.py``'s
``INPUT_SEQUENCE_LENGTH = 6``: 5 velocities × dim, 2 × dim boundary distances,
``particle_type_embedding_size=16``, edge = displacement + distance: ``full`` 2-D, node_in =
10 + 4 + 16 = 30, edge_in = 3; ``xl`` 3-D, node_in = 15 + 6 + 16 = 37, edge_in = 4). Graph sizes:
the paper trains "with thousands of particles" and tests on "at least an order of magnitude more"
(its abstract): ``full`` has 2,048 particles per graph, ``xl`` 32,768. The per-dataset particle
counts and edge counts were not found in the stored references, so ``edges = 16 × nodes`` (16
neighbours per particle within the connectivity radius) is an assumption; the PartIR paper (arXiv 2401.11202) evaluates a GNS but
its sizes were not found either. Parameters: 1,591,682 (``full``) and 1,592,835 (``xl``).

Parameter count (closed form, :func:`param_count`), with h = latent, L = mlp_layers and
``mlp(a, o) = a·h + h + (L-1)·(h² + h) + h·o + o`` (+ 2·o for a LayerNorm)::

    mlp_ln(node_in, h) + mlp_ln(edge_in, h) + steps·(mlp_ln(3h, h) + mlp_ln(2h, h)) + mlp(h, dim)

**Model FLOPs** of one training step (:func:`model_flops`, the numerator of MFU): the MLP matmuls'
multiply-accumulates, ``macs(a, o) = a·h + (L-1)·h² + h·o`` per row, ×2 FLOPs per MAC, ×3 for the
forward and both gradients::

    6 · graphs · [nodes · (macs(node_in, h) + steps·macs(2h, h) + macs(h, dim))
                  + edges · (macs(edge_in, h) + steps·macs(3h, h))]

Not counted: gathers, scatter-adds, norms, activations, the loss. As for the MLP, the input
gradients of the two encoders' first layers (whose inputs are data) are counted though the step
does not compute them (the test checks the traced program's matmul FLOPs equal this minus them).

**Strategies.** Data axes: every mesh axis except ``model``.

- ``bp``: the graphs (dim 0 of every ``batch/*``) on the data axes: each device runs whole graphs;
  the only collectives are the gradients' all-reduces. ``z2``, ``z3``: ZeRO on top of ``bp``
  (:func:`scenarios.strategies.build_strategy`). ``bp`` needs ``graphs`` divisible by the data axes.
- ``edge``: the edge arrays (dim 1 of ``batch/edges``, ``senders``, ``receivers``) on the data axes;
  node arrays replicated. The edge encoder and each step's edge MLP run on local edges; the
  gathers of ``x[senders]``/``x[receivers]`` read the replicated node table locally; the node
  aggregation is a scatter-add of local messages, a pending sum resolved by ONE all_reduce of
  [G, N, latent] over the edge axes per message-passing step (forward); the node MLPs run
  replicated. Backward: the gather's gradient (a scatter-add of the local edges' cotangents into
  the node table) is a pending sum too, one all_reduce of [G, N, latent] per step (both endpoints
  are one gather, ``gns_model.forward``: two gathers would cost two, as each pending sum is
  resolved where it meets the full cotangent); the aggregation's gradient is a local gather; the
  edge MLPs' weight gradients are all-reduced. No collective carries an edge-sized array.
- ``node``: the node arrays (dim 1 of ``batch/nodes`` and ``batch/targets``) on the data axes; edge
  arrays replicated. Node MLPs run on local nodes; every edge gather needs the whole node table,
  so each step all-gathers the [G, N, latent] node latents (the graph is random, any edge may read
  any node), and the edge MLPs run replicated on every device; the aggregation lands in the
  tiled node table without a collective. Backward: one all_gather of the aggregation's [G, N, latent]
  cotangent per step (its gradient gathers it at the receivers), the node MLPs' weight gradients
  all-reduced.
- ``bp+edge``: graphs on the data axes and each graph's edges on ``model`` (the GNS has no Megatron
  layers: splitting one example's edges is its model parallelism); needs a ``model`` axis.
- ``edge+z3``, ``node+z3``: ``edge`` / ``node`` with ZeRO-3 on the data axes of the MLPs that sharding
  makes data-parallel (``ZERO_KINDS``: the edge encoder and edge MLPs; the node encoder, node MLPs
  and decoder), their Adam moments alike: all-gathered before use, gradients reduce-scattered.
  The other MLPs run replicated on those axes and keep whole parameters: a ZeRO tiling of theirs
  would propagate into their replicated activations' feature dim instead of being all-gathered
  (the compiler reports the tactic conflicting with itself; on ``full``, ``node+z3`` then moved
  100 MB edge activations per all_gather).
"""
from __future__ import annotations

from partir_emu.compiler.tactics import AutomaticPartition, ManualPartition, Tactic
from partir_emu.core.mesh import Mesh
from partir_emu.errors import ScenarioError
from scenarios.common import MODEL_AXIS, Config, ParamKind, Scenario
from scenarios.gns import model as gns_model
from scenarios.strategies import build_strategy, check_mesh, data_axes

SIZE_NAMES = ("graphs", "nodes", "edges", "latent", "mlp_layers", "steps", "node_in", "edge_in", "dim")

PRESETS: dict[str, Config] = {
    "tiny": dict(graphs=4, nodes=16, edges=64, latent=16, mlp_layers=2, steps=2, node_in=8, edge_in=3, dim=2),
    # the reference model (train.py) on 2-D particle graphs of 2,048 particles, 16 edges each (see above)
    "full": dict(graphs=2, nodes=2048, edges=32768, latent=128, mlp_layers=2, steps=10, node_in=30, edge_in=3,
                 dim=2),
    # the same model on 3-D graphs an order of magnitude larger
    "xl": dict(graphs=2, nodes=32768, edges=524288, latent=128, mlp_layers=2, steps=10, node_in=37, edge_in=4,
               dim=3),
}

# Grouped so that the shapes of a kind share a dim ZeRO can tile: the encoders' first weights
# ([node_in|edge_in, latent]) and the decoder's output layer ([latent, dim], [dim]) have small dims.
PARAM_KINDS = (
    ParamKind("encoder/*/layer_0/w", 2), ParamKind("encoder/*/layer_[1-9]*/w", 2), ParamKind("encoder/*/b", 1),
    ParamKind("step_*/w", 2), ParamKind("step_*/b", 1),
    ParamKind("decoder/*/w", 2), ParamKind("decoder/*/b", 1),
    ParamKind("*/norm/*", 1),
)

param_shapes = gns_model.param_shapes
batch_shapes = gns_model.batch_shapes


def _check_config(cfg: Config) -> None:
    if cfg["edges"] < 2 * cfg["nodes"]:
        raise ScenarioError(f"gns: edges={cfg['edges']} < 2 × nodes={cfg['nodes']}; every node sends and receives "
                            "an edge, so use --set edges=... at least twice nodes")


# -- counts --------------------------------------------------------------------------------------

def _mlp_params(a: int, o: int, h: int, L: int, norm: bool) -> int:
    return a * h + h + (L - 1) * (h * h + h) + h * o + o + (2 * o if norm else 0)


def _macs(a: int, o: int, h: int, L: int) -> int:
    return a * h + (L - 1) * h * h + h * o


def param_count(cfg: Config) -> int:
    h, L, S = cfg["latent"], cfg["mlp_layers"], cfg["steps"]
    return (_mlp_params(cfg["node_in"], h, h, L, True) + _mlp_params(cfg["edge_in"], h, h, L, True)
            + S * (_mlp_params(3 * h, h, h, L, True) + _mlp_params(2 * h, h, h, L, True))
            + _mlp_params(h, cfg["dim"], h, L, False))


def model_flops(cfg: Config) -> int:
    h, L, S = cfg["latent"], cfg["mlp_layers"], cfg["steps"]
    per_node = _macs(cfg["node_in"], h, h, L) + S * _macs(2 * h, h, h, L) + _macs(h, cfg["dim"], h, L)
    per_edge = _macs(cfg["edge_in"], h, h, L) + S * _macs(3 * h, h, h, L)
    return 6 * cfg["graphs"] * (cfg["nodes"] * per_node + cfg["edges"] * per_edge)


def make_step(cfg: Config, *, lr: float = 1e-3, grads_only: bool = False):
    return gns_model.make_step(cfg, lr=lr, grads_only=grads_only)


# -- strategies ----------------------------------------------------------------------------------

EDGE_INPUTS = ("batch/edges", "batch/senders", "batch/receivers")
NODE_INPUTS = ("batch/nodes", "batch/targets")


def _tile(name: str, what: str, inputs: tuple[str, ...], size_name: str, axes: list[str], mesh: Mesh,
          cfg: Config | None) -> list[ManualPartition]:
    """Dim 1 of ``inputs`` (the ``size_name`` dim) on each of ``axes``."""
    if cfg is not None and cfg[size_name] % mesh.group_size(axes):
        raise ScenarioError(f"strategy {name!r}: {size_name}={cfg[size_name]} is not divisible by the axes {axes} "
                            f"of {mesh} (product {mesh.group_size(axes)}); change --set {size_name}=... or the mesh")
    return [ManualPartition({p: 1 for p in inputs}, axis=ax, name=f"{what}:{ax}") for ax in axes]


# ZeRO-3 under ``edge`` / ``node``: only the MLPs whose activations that sharding tiles on the data
# axes (the edge MLPs; the node MLPs and the decoder). A parameter of an MLP whose activations are
# replicated on the axis would not be all-gathered: propagation would carry its tiling into those
# activations' feature dim (a tactic conflicting with itself, reduce-scatters and all-gathers of
# [G, E|N, latent] activations), so those stay replicated.
ZERO_KINDS = {
    "edge": (ParamKind("encoder/edge/layer_0/w", 2), ParamKind("encoder/edge/layer_[1-9]*/w", 2),
             ParamKind("encoder/edge/layer_*/b", 1), ParamKind("step_*/edge/*/w", 2),
             ParamKind("step_*/edge/*/b", 1), ParamKind("*/edge/norm/*", 1)),
    "node": (ParamKind("encoder/node/layer_0/w", 2), ParamKind("encoder/node/layer_[1-9]*/w", 2),
             ParamKind("encoder/node/layer_*/b", 1), ParamKind("step_*/node/*/w", 2),
             ParamKind("step_*/node/*/b", 1), ParamKind("*/node/norm/*", 1),
             ParamKind("decoder/*/w", 2), ParamKind("decoder/*/b", 1)),
}


def _zero3(what: str, mesh: Mesh, cfg: Config | None) -> list[ManualPartition]:
    """ZeRO-3 of the ``what`` (edge|node) MLPs: ``build_strategy``'s z3 tactics without its batch tactics."""
    # batch_size 0: build_strategy checks the graphs against the data axes only for its bp part,
    # which is dropped here (the graphs stay whole)
    tactics = build_strategy("z3", mesh, cfg, kinds=ZERO_KINDS[what], param_shapes=param_shapes,
                             batch_size=lambda _c: 0)
    return [t for t in tactics if not t.name.startswith("bp:")]


def graph_strategy(name: str, mesh: Mesh, cfg: Config | None) -> list[ManualPartition]:
    """``edge``, ``node``, ``bp+edge``, ``edge+z3``, ``node+z3``: see the module docstring."""
    parts = name.split("+")
    check_mesh(mesh, name, need_data=True, need_model="bp" in parts)
    daxes = data_axes(mesh)
    tactics: list[ManualPartition] = []
    if "bp" in parts:
        # the graphs on the data axes, the edges of each graph on ``model`` (the GNS has no Megatron
        # layers: splitting one example's edges is its model parallelism)
        group = mesh.group_size(daxes)
        if cfg is not None and cfg["graphs"] % group:
            raise ScenarioError(f"strategy {name!r}: graphs={cfg['graphs']} is not divisible by the data axes {daxes} "
                                f"of {mesh} (product {group}); change --set graphs=... or the mesh")
        tactics += [ManualPartition({"batch/*": 0}, axis=ax, name=f"bp:{ax}") for ax in daxes]
        daxes = [MODEL_AXIS]
    what = "edge" if "edge" in parts else "node"
    if what == "edge":
        tactics += _tile(name, "edge", EDGE_INPUTS, "edges", daxes, mesh, cfg)
    else:
        tactics += _tile(name, "node", NODE_INPUTS, "nodes", daxes, mesh, cfg)
    if "z3" in parts:
        tactics += _zero3(what, mesh, cfg)
    return tactics


STRATEGY_NAMES = ("bp", "z2", "z3", "edge", "node", "bp+edge", "edge+z3", "node+z3", "bp+auto")


def auto_strategy(mesh: Mesh, cfg: Config | None) -> list[Tactic]:
    """``bp+auto``: the graphs on the data axes, then the ``model`` axis searched over the parameters
    *and* the graph arrays (so the search may split a graph's edges or nodes, as ``bp+edge`` does,
    shard MLP weights, or leave ``model`` alone)."""
    bp = [t for t in _make("bp")(mesh, cfg) if t.name.startswith("bp:")]
    check_mesh(mesh, "bp+auto", need_data=True, need_model=True)
    return [*bp, AutomaticPartition(MODEL_AXIS, inputs=("params/*", "batch/*"), name=f"auto:{MODEL_AXIS}")]


def _make(n: str):
    def strategy(mesh: Mesh, cfg: Config | None = None) -> list[Tactic]:
        if n == "bp+auto":
            return auto_strategy(mesh, cfg)
        if "edge" in n.split("+") or "node" in n.split("+"):
            return graph_strategy(n, mesh, cfg)
        check_mesh(mesh, n, need_data=True, need_model=False)
        # checked here to name the size: build_strategy's own message asks for --set batch=...
        group = mesh.group_size(data_axes(mesh))
        if cfg is not None and cfg["graphs"] % group:
            raise ScenarioError(f"strategy {n!r}: graphs={cfg['graphs']} is not divisible by the data axes "
                                f"{data_axes(mesh)} of {mesh} (product {group}); change --set graphs=... or the "
                                "mesh, or shard the edges instead (strategy 'edge')")
        return build_strategy(n, mesh, cfg, kinds=PARAM_KINDS, param_shapes=param_shapes,
                              batch_size=lambda c: c["graphs"])
    strategy.__name__ = strategy.__qualname__ = f"strategy_{n.replace('+', '_')}"
    strategy.__doc__ = f"Strategy {n!r}: see scenarios.gns.scenario."
    return strategy


SCENARIO = Scenario(
    name="gns",
    description="Graph Network Simulator training step (edge gathers, scatter-add message passing, MLPs, Adam)",
    size_names=SIZE_NAMES,
    presets=PRESETS,
    simulation_only=frozenset({"full", "xl"}),
    make_step=make_step,
    param_shapes=param_shapes,
    batch_shapes=batch_shapes,
    make_params=gns_model.make_params,
    make_batch=gns_model.make_batch,
    param_count=param_count,
    model_flops=model_flops,
    param_kinds=PARAM_KINDS,
    strategies={n: _make(n) for n in STRATEGY_NAMES},
    check_config=_check_config,
)

__all__ = ["SCENARIO", "PRESETS", "SIZE_NAMES", "STRATEGY_NAMES", "param_count", "model_flops", "param_shapes",
           "make_step"]
