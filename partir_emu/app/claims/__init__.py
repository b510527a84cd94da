"""Predictability claims as tests: :func:`predict` a configuration, assert what is claimed of it,
and keep its figures as a reviewed baseline (the pytest plugin, :mod:`partir_emu.testing.plugin`).

    from partir_emu.testing import assert_faster, assert_fits, predict

    def test_megatron_beats_zero_on_v4():
        mp = predict("transformer", "bp+mp+z3", "batch=16,model=4", "tpu-v4", size="small")
        z3 = predict("transformer", "bp+z3", "batch=64", "tpu-v4", size="small")
        assert_faster(mp, z3, by=0.10)
        assert_fits(mp, hbm="16GiB")

    def test_counts_do_not_change(partir_baseline):
        partir_baseline.check(predict("transformer", "bp+mp", "batch=4,model=2", size="tiny"))

Importing this package imports neither jax nor the hardware models: :func:`predict` loads them.
"""
from __future__ import annotations

from typing import Any

from partir_emu.app.claims.assertions import (
    ClaimFailed,
    assert_collectives,
    assert_faster,
    assert_fits,
    assert_verified,
    assert_within,
)
from partir_emu.app.claims.baselines import Baselines
from partir_emu.app.claims.prediction import Prediction


def predict(what: Any, strategy: str | None = None, mesh: Any = None, hardware: str = "tpu-v4", *,
            size: str | None = None, set: Any = None, stack: str = "xla", placement: str | None = None,
            overlap: bool = True, label: str | None = None) -> Prediction:
    """The analytical model's :class:`Prediction` for ``what``:

    * a scenario name (``"transformer"``, see ``partir-emu list``) with ``strategy``, ``mesh``
      (``"batch=8,model=2"``, a dict or a :class:`~partir_emu.Mesh`), ``size`` (a preset) and ``set``
      (overrides, ``"batch=64,layers=4"`` or a dict), as ``partir-emu simulate`` takes them;
    * or a user's lowered step: a ``Lowered`` (``pe.jit(f, mesh=..., schedule=...).lower(*args)``) or
      an ``SpmdProgram`` (then ``strategy``/``mesh``/``size``/``set`` must be left out).

    ``hardware`` is a spec name or TOML path (``partir-emu hardware``), ``stack`` a software stack,
    ``placement`` ``None``/``"auto"`` (the search ``simulate`` runs), ``"default"`` or explicit text."""
    from partir_emu.app.claims import model  # why: the plugin loads in every pytest run, the model when a test predicts

    return model.predict(what, strategy, mesh, hardware, size=size, set=set, stack=stack, placement=placement,
                         overlap=overlap, label=label)


__all__ = ["Baselines", "ClaimFailed", "Prediction", "assert_collectives", "assert_faster", "assert_fits",
           "assert_verified", "assert_within", "predict"]
