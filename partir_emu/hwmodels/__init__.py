"""Hardware models: specs (data files), topologies, placement, and the analytical simulator.

Imports neither jax nor mpi4py. The DES (``hwmodels/des``) reuses ``Topology.route``
and ``Placement.chip_of``.
"""
from partir_emu.hwmodels.analytical import Analyzer, CollectiveRow, SimReport, simulate
from partir_emu.hwmodels.compute.costs import cost_rules, eqn_cost, op_kind
from partir_emu.hwmodels.compute.memory import MemoryProfile, peak_memory
from partir_emu.hwmodels.machine.placement import GroupLayout, Placement, place
from partir_emu.hwmodels.machine.slices import topology_for
from partir_emu.hwmodels.machine.specs import HardwareSpec, SpecLoader, list_specs, load_spec
from partir_emu.hwmodels.machine.topology import Link, Topology
from partir_emu.hwmodels.network.choice import choose_algorithm
from partir_emu.hwmodels.network.comm import CommModel, PriceCache, price_schedule

__all__ = [
    "simulate", "SimReport", "CollectiveRow", "Analyzer",
    "load_spec", "list_specs", "HardwareSpec", "SpecLoader",
    "Topology", "Link", "topology_for",
    "Placement", "GroupLayout", "place",
    "choose_algorithm", "price_schedule", "CommModel", "PriceCache",
    "peak_memory", "MemoryProfile",
    "cost_rules", "eqn_cost", "op_kind",
]
