"""The discrete-event (simpy) model of TPU ICI tori and GPU clusters that validates the analytical one.

>>> rep = simulate_des(spmd, "tpu-v4")                  # same inputs as analytical.simulate
>>> rep.step_s, rep.top_links[0]

Modules: :mod:`.model` (the simulation: wires the parts below), :mod:`.protocols` (what
each part sees of the others), :mod:`.stream` (the op stream a device runs; loops run
iteration by iteration), :mod:`.device` (devices running it, SPMD symmetry),
:mod:`.collective` (schedules over all groups), :mod:`.plans` (their steps as flows),
:mod:`.classes` (symmetry classes of members and flows), :mod:`partir_emu.hwmodels.des.network.flows` (flow-level max-min),
:mod:`partir_emu.hwmodels.des.network.chunked` (store-and-forward), :mod:`partir_emu.hwmodels.des.network.routing` (routes, degraded/failed links),
:mod:`.report` (the report and the Perfetto trace), :mod:`.engine_network` (the flow network as a
network model of the timeline engine), :mod:`partir_emu.hwmodels.validation.des` (analytical vs DES
on given programs), :mod:`partir_emu.hwmodels.validation.replay` (MPI message traces). The command line (``simulate-des``, ``validate``,
``replay``) and the validation suites live in :mod:`partir_emu.app`. Imports neither jax
nor mpi4py.
"""
from partir_emu.hwmodels.des.model import DesError, DesOptions, Simulation, simulate_des
from partir_emu.hwmodels.des.network.rates import max_min_rates
from partir_emu.hwmodels.des.network.routing import FlowRouter, parse_links
from partir_emu.hwmodels.des.network.spans import FlowNetwork
from partir_emu.hwmodels.des.report import DesCollectiveRow, DesReport, LinkRow

__all__ = ["simulate_des", "DesOptions", "DesReport", "DesCollectiveRow", "LinkRow", "DesError", "Simulation",
           "FlowNetwork", "max_min_rates", "FlowRouter", "parse_links"]
