"""The predictability-claims plugin as a user meets it, each suite in a child pytest (its own plugin
manager, the plugin loaded from the installed ``pytest11`` entry point, nothing passed by hand):

* the example suite ``examples/claims`` passes as shipped, baselines included;
* a deliberately broken change fails a claims suite with the figure named: the all-reduce code
  motion of ``compiler/lowering/sink.py`` switched off (the gradient all-reduces of a microbatched
  step go back into the loop: more collectives, a slower step), and every collective priced twice as
  slow (the step moves, the counts do not);
* ``--partir-update-baselines`` rewrites the snapshot, after which the same suite passes, and the
  old good code now fails against it.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUITE = '''
from partir_emu.testing import predict

def test_step_does_not_move(partir_baseline):
    partir_baseline.check(predict("transformer", "bp", "batch=2", "tpu-v4", size="tiny",
                                  set="batch=8,layers=1,microbatches=4"))
'''
NO_SINK = '''
import partir_emu.compiler.lowering.loops as loops
loops.sink_all_reduces = lambda body, *args: (body, ())   # the broken change
'''
SLOW_COLLECTIVES = '''
import partir_emu.hwmodels.network.contention as contention
_price = contention.Fabric.price
def _slow(self, *args, **kwargs):                                   # the broken change
    t, messages, hops = _price(self, *args, **kwargs)
    return 2 * t, messages, hops
contention.Fabric.price = _slow
'''


def _pytest(where: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(where), *args], cwd=where, env=env, capture_output=True, text=True, timeout=600)


def test_the_plugin_is_installed_as_a_pytest11_entry_point():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert eps.get("partir_emu") == "partir_emu.testing.plugin", eps


def test_the_example_suite_passes_as_shipped(tmp_path):
    suite = tmp_path / "claims"
    shutil.copytree(ROOT / "examples" / "claims", suite)
    run = _pytest(suite)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "5 passed" in run.stdout, run.stdout


def test_a_broken_change_fails_and_update_rewrites_the_baseline(tmp_path):
    (tmp_path / "test_claims.py").write_text(SUITE)
    snapshot = tmp_path / "baselines" / "test_claims" / "test_step_does_not_move.json"
    run = _pytest(tmp_path)
    assert run.returncode == 1 and "no baseline" in run.stdout and "--partir-update-baselines" in run.stdout
    run = _pytest(tmp_path, "--partir-update-baselines")
    assert run.returncode == 0 and f"wrote {snapshot}" in run.stdout, run.stdout + run.stderr
    good = json.loads(snapshot.read_text())["figures"]
    assert _pytest(tmp_path).returncode == 0

    (tmp_path / "conftest.py").write_text(NO_SINK)
    run = _pytest(tmp_path)
    assert run.returncode == 1, run.stdout
    n = good["collectives"]["all_reduce@batch"]
    assert f"collectives all_reduce@batch: {n} -> " in run.stdout, run.stdout
    assert "step_s: " in run.stdout and "(if the change is intended: pytest --partir-update-baselines" in run.stdout

    (tmp_path / "conftest.py").write_text(SLOW_COLLECTIVES)
    run = _pytest(tmp_path)
    assert run.returncode == 1 and "step_s: " in run.stdout and "tolerance 2 %" in run.stdout, run.stdout
    assert "collectives all_reduce" not in run.stdout, run.stdout          # a slower price, the same program

    # accepting the change rewrites the snapshot; then the good code is the one that fails
    assert _pytest(tmp_path, "--partir-update-baselines").returncode == 0
    assert json.loads(snapshot.read_text())["figures"]["step_s"] > good["step_s"]
    assert _pytest(tmp_path).returncode == 0
    (tmp_path / "conftest.py").unlink()
    run = _pytest(tmp_path)
    assert run.returncode == 1 and "step_s: " in run.stdout, run.stdout
