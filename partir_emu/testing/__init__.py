"""Predictability claims as tests, for users' own suites: :func:`predict` a configuration, assert what
is claimed of it (:func:`assert_faster`, :func:`assert_fits`, :func:`assert_within`,
:func:`assert_collectives`, :func:`assert_verified`) and keep its figures as a reviewed baseline
(fixture ``partir_baseline`` of the pytest plugin, :mod:`partir_emu.testing.plugin`, installed with
the package). The logic lives in :mod:`partir_emu.app.claims`; this is its public name.

Importing this package imports neither jax nor the hardware models: :func:`predict` loads them.
"""
from __future__ import annotations

from partir_emu.app.claims import (
    Baselines,
    ClaimFailed,
    Prediction,
    assert_collectives,
    assert_faster,
    assert_fits,
    assert_verified,
    assert_within,
    predict,
)

__all__ = ["Baselines", "ClaimFailed", "Prediction", "assert_collectives", "assert_faster", "assert_fits",
           "assert_verified", "assert_within", "predict"]
