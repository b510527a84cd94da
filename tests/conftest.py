"""Shared fixtures. Tests run on the CPU; jax is imported only where a test needs it."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


@functools.cache
def scenario_case(name: str, overrides: str | None = None):
    """(program, flat inputs, reference outputs) of a scenario at its tiny size, computed once."""
    import jax

    from partir_emu.api import trace
    from partir_emu.app.experiment import flatten
    from scenarios import get_scenario
    s = get_scenario(name)
    cfg = s.config("tiny", overrides)
    step = s.make_step(cfg)
    inputs = s.make_inputs(cfg, 0)
    prog = trace(step, *s.abstract_inputs(cfg))
    ref = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.jit(step)(*inputs))]
    return s, cfg, prog, flatten(inputs), ref


@pytest.fixture
def case():
    return scenario_case
