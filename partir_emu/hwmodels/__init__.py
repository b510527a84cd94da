"""Hardware models: specs (data files), topologies, placement, and the analytical simulator.

Imports neither jax nor mpi4py. The DES (``hwmodels/des``) reuses ``Topology.route``
and ``Placement.chip_of``.
"""
from partir_emu.hwmodels.algorithm_choice import choose_algorithm
from partir_emu.hwmodels.analytical import DEFAULT_ANALYZER, Analyzer, CollectiveRow, SimReport, simulate
from partir_emu.hwmodels.comm import CommModel, PriceCache, price_schedule
from partir_emu.hwmodels.costs import cost_rules, eqn_cost, op_kind
from partir_emu.hwmodels.memory import MemoryProfile, peak_memory
from partir_emu.hwmodels.placement import GroupLayout, Placement, place
from partir_emu.hwmodels.specs import HardwareSpec, SpecLoader, list_specs, load_spec
from partir_emu.hwmodels.topology import Link, Topology, topology_for

__all__ = [
    "simulate", "SimReport", "CollectiveRow", "Analyzer", "DEFAULT_ANALYZER",
    "load_spec", "list_specs", "HardwareSpec", "SpecLoader",
    "Topology", "Link", "topology_for",
    "Placement", "GroupLayout", "place",
    "choose_algorithm", "price_schedule", "CommModel", "PriceCache",
    "peak_memory", "MemoryProfile",
    "cost_rules", "eqn_cost", "op_kind",
]
