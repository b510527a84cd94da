"""Models a user tries first, each with sizes (emulation and full) and named strategies.

>>> from scenarios import get_scenario
>>> sc = get_scenario("transformer")
>>> cfg = sc.config("tiny", "batch=16")
>>> params, opt, batch = sc.make_inputs(cfg, seed=0)
>>> loss, params, opt = sc.make_step(cfg)(params, opt, batch)
>>> tactics = sc.strategies["bp+mp"](Mesh(batch=2, model=2), cfg)
"""
from __future__ import annotations

from scenarios.common import ParamKind, Scenario, get_scenario, list_scenarios, resolve_size
from scenarios.strategies import data_axes
from scenarios.training import adam_init, adam_update
from scenarios.trees import input_names

__all__ = ["Scenario", "ParamKind", "get_scenario", "list_scenarios", "resolve_size", "adam_init", "adam_update",
           "input_names", "data_axes"]
