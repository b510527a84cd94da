"""Several scalable units (SUs) of GPU nodes joined by a core through oversubscribed uplinks.

A GPU cluster is built of scalable units: NVIDIA's DGX SuperPOD puts 32 DGX H100 nodes in a unit
under 8 rail leaves and joins the units by spine (and, from 16 units, core) switches, with as many
cables up each tier as down (its reference architecture's component tables: non-blocking, ratio 1).
Other clusters taper the tier that joins the units: Meta's 24K-GPU H100 clusters that trained Llama 3
are pods of 3,072 GPUs at full bisection joined by aggregation switches at 1:7 (Llama 3 paper, arXiv
2407.21783, section 3.3.1). A spec says so with ``[topology] spine_oversubscription`` (>= 1, with its
source); without the field the cluster is as :meth:`.topology.Topology.gpu_cluster` builds it (every
leaf under one non-blocking spine).

With the field, a cluster of more than ``nodes_per_su`` nodes is :class:`ScalableUnits`: the NVLink
and NIC links and the leaves as before (fat tree: ``nodes_per_leaf`` whole nodes per leaf, which must
divide the unit; rail-optimized: leaf ``r`` of unit ``s`` takes NIC ``r`` of its nodes), and then

- each leaf up to its unit's spine group ``spine{s}`` and back, at the leaf's NIC bandwidth
  (non-blocking inside a unit, as before);
- each spine group up to the ``core`` and back at its unit's NIC bandwidth divided by the ratio
  (``k_s · nic_bw / ratio``, ``k_s`` the unit's NICs): what crosses units shares that.

Routes: inside a node NVSwitch; under one leaf NIC, leaf, NIC; across leaves of a unit NIC, leaf,
``spine{s}``, leaf, NIC (4 links, as before); across units NIC, leaf, ``spine{s}``, ``core``,
``spine{t}``, leaf, NIC (6 links). Both hardware models take every route from here (the analytical
model's contention pricing and the DES's flows), so a collective whose groups cross units shares the
uplinks of their units in both. A ring across two units through uplinks of ratio ``R``: every member
of a unit sends across at once, each at ``nic_bw / R`` (``tests/unit/test_hw_superpod.py``). For 2-8
SuperPOD units NVIDIA's design has no core tier (the spines join the leaves of every unit directly),
so there a route across units has two hops (about 2 µs) more here than on the real fabric.
"""
from __future__ import annotations

from partir_emu.errors import PlacementError
from partir_emu.hwmodels.machine.specs import GpuClusterSpec
from partir_emu.hwmodels.machine.topology import Link, Node, Topology

CORE = "core"


class ScalableUnits(Topology):
    """GPU nodes in scalable units whose spine groups join a core (module docstring). Build with
    :func:`gpu_topology`."""

    __slots__ = ("units", "unit_of_leaf", "ratio")
    units: int
    unit_of_leaf: dict[str, int]
    ratio: float

    @classmethod
    def build(cls, base: Topology, net: GpuClusterSpec, name: str = "") -> ScalableUnits:
        """``base`` (:meth:`Topology.gpu_cluster` of the same GPUs) with its one spine replaced by a
        spine group per unit and a core above them."""
        assert net.spine_oversubscription is not None     # why: gpu_topology builds this only then
        links = [lk for lk in base.links if "spine" not in (lk.src, lk.dst)]
        assert all(lk.id == i for i, lk in enumerate(links))   # why: the spine links come last
        per_unit = net.nodes_per_su
        per_node = base.dims[1]
        unit_of_leaf = {leaf: (chip // per_node) // per_unit for chip, leaf in base.leaf_of.items()}
        ports: dict[str, int] = {}
        for leaf in base.leaf_of.values():
            ports[leaf] = ports.get(leaf, 0) + 1

        def add(src: str, dst: str, bw: float, label: str) -> None:
            links.append(Link(len(links), src, dst, bw, net.ib_latency_s, "ib", label))

        for leaf, k in ports.items():
            spine = f"spine{unit_of_leaf[leaf]}"
            add(leaf, spine, k * net.nic_bw_bytes_per_s, f"ib {leaf}->{spine}")
            add(spine, leaf, k * net.nic_bw_bytes_per_s, f"ib {spine}->{leaf}")
        units = max(unit_of_leaf.values()) + 1
        for s in range(units):
            nics = sum(k for leaf, k in ports.items() if unit_of_leaf[leaf] == s)
            up = nics * net.nic_bw_bytes_per_s / net.spine_oversubscription
            add(f"spine{s}", CORE, up, f"ib spine{s}->{CORE}")
            add(CORE, f"spine{s}", up, f"ib {CORE}->spine{s}")
        self = cls("gpu", base.dims, base.dim_names, base.wrap, tuple(links), name, base.leaf_of)
        self.units, self.unit_of_leaf, self.ratio = units, unit_of_leaf, float(net.spine_oversubscription)
        return self

    def _gpu_route(self, src: int, dst: int) -> list[Link]:
        if src == dst:
            return []
        per = self.dims[1]
        if src // per == dst // per:
            return super()._gpu_route(src, dst)
        ls, ld = self.leaf_of[src], self.leaf_of[dst]
        if ls == ld:
            return [self._by_ends[(src, ls)], self._by_ends[(ld, dst)]]
        us, ud = f"spine{self.unit_of_leaf[ls]}", f"spine{self.unit_of_leaf[ld]}"
        hops: list[tuple[Node, Node]] = [(src, ls), (ls, us)]
        hops += [(us, CORE), (CORE, ud)] if us != ud else []
        hops += [(ud, ld), (ld, dst)]
        return [self._by_ends[h] for h in hops]

    def describe(self) -> str:
        nodes, per = self.dims
        return (f"{self.name or 'gpu'} {nodes} node(s) x {per} GPUs (NVSwitch + InfiniBand) in {self.units} scalable "
                f"units, spine uplinks oversubscribed {self.ratio:g}:1")

    __str__ = describe


def gpu_topology(num_gpus: int, net: GpuClusterSpec, name: str = "") -> Topology:
    """The topology of ``num_gpus`` GPUs of ``net``: :class:`ScalableUnits` when the spec gives
    ``spine_oversubscription`` and the GPUs span more than one unit, else one spine (module docstring)."""
    base = Topology.gpu_cluster(num_gpus, net, name)
    if net.spine_oversubscription is None or base.dims[0] <= net.nodes_per_su:
        return base
    if net.fabric == "fat_tree" and net.nodes_per_su % net.nodes_per_leaf:
        raise PlacementError(f"{name or 'the spec'}: a scalable unit of {net.nodes_per_su} nodes "
                             f"(topology.nodes_per_su) is not whole leaves of {net.nodes_per_leaf} nodes "
                             f"(topology.nodes_per_leaf); make the unit a multiple of the leaf")
    return ScalableUnits.build(base, net, name)


__all__ = ["CORE", "ScalableUnits", "gpu_topology"]
