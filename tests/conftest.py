"""Shared fixtures. Tests run on the CPU; jax is imported only where a test needs it."""
from __future__ import annotations

import functools
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.extended import EXTENDED

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU back end at -O0 (partir_emu.app.xla.compare.FAST_COMPILE): every test, and every child
# process it starts, compiles jax.jit references, and compiling is much of their time (the UNet
# test 28 s -> 22 s; 4 % over test_transformer_shapes and test_unet). The references still are jax.jit's numbers, in another rounding: the verdict
# judges by allowances that hold for any summation order and BLAS kernel (issue 20). A caller's own
# optimization level wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    from partir_emu.app.xla.compare import FAST_COMPILE
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

# Wall-clock limits in tests (how soon a signal stops a job, a timeout fires) are what a quiet
# 2-core machine needs, times this: the suite must hold with other work beside it. Raise it on a
# slower machine; speed itself is measured by benchmarks/, never asserted by a test.
PROGRAMS_ENV = "PARTIR_EMU_TEST_PROGRAMS"     # the session's program cache directory
WALL_SLACK = float(os.environ.get("PARTIR_EMU_WALL_SLACK", "3"))


def pytest_configure(config: pytest.Config) -> None:
    """One jax compilation cache and one program cache for the whole session (the xdist workers and
    the XLA and MPI child processes inherit the environment): the same unpartitioned steps are
    compiled, and the same strategies lowered, by many test modules and child processes, and on this
    machine compiling and lowering, not running, is most of a test's time."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return                                    # an xdist worker, or the caller chose a cache
    path = tempfile.mkdtemp(prefix="partir-emu-test-caches-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(path, "jax")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ.setdefault(PROGRAMS_ENV, os.path.join(path, "programs"))      # lowered(): one program cache
    config._partir_emu_jax_cache = path           # type: ignore[attr-defined]


TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "xla", "mpi")     # the tier folders of tests/ (docs/tests.md); each is a marker


def tier(path: Path) -> str | None:
    """The tier folder a test file lives in (``tests/<tier>/...``), None outside them."""
    try:
        first = Path(path).resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test gets the marker of its tier folder, as it is collected (before ``-m`` selects: ``-m unit``,
    ``-m "not xla"``); a mark it has already is kept. A test listed in ``tests/extended.py`` is marked
    ``extended`` (``make test`` leaves it to ``make test-all``)."""
    name = tier(item.path)
    if name and item.get_closest_marker(name) is None:
        item.add_marker(getattr(pytest.mark, name))
    hits = [p for p in EXTENDED if item.nodeid.startswith(p)]
    if hits:
        item.add_marker(pytest.mark.extended)
        item.config.__dict__.setdefault("_partir_emu_extended_hits", set()).update(hits)


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the whole suite was collected, every prefix of ``tests/extended.py`` must have matched a test:
    a renamed test would otherwise leave the list unnoticed."""
    config = session.config
    whole = [Path(a).resolve() for a in (config.args or ["tests"])] == [TESTS]
    if not whole or session.testsfailed:
        return
    unmatched = set(EXTENDED) - config.__dict__.get("_partir_emu_extended_hits", set())
    if unmatched:
        raise pytest.UsageError(f"tests/extended.py lists {len(unmatched)} node-id prefix(es) that match no test, "
                                f"e.g. {sorted(unmatched)[0]!r}: rename the entry with its test, or remove it")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` (``make test``) xdist puts the tests of one ``xdist_group`` (one XLA
    child, one mpiexec launch, one set of references) on one worker by suffixing their node ids; a
    pytest that xdist cannot rename would silently spread them and run every launch twice."""
    if not config.getoption("loadgroup", default=False):
        return
    lost = [it.nodeid for it in items if it.get_closest_marker("xdist_group") and "@" not in it.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup did not group {len(lost)} tests (e.g. {lost[0]}): this pytest "
                                f"and pytest-xdist do not work together; install requirements.lock (make setup)")


def pytest_unconfigure(config: pytest.Config) -> None:
    path = getattr(config, "_partir_emu_jax_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


def default_signals(argv: list[str]) -> list[str]:
    """``argv`` run with SIGINT, SIGTERM and SIGHUP at their defaults, for a test that signals it: a
    suite started under ``nohup`` (SIGHUP ignored) or as a script's background job (SIGINT
    ignored) hands those dispositions down, and partir-emu rightly keeps a signal ignored that
    its parent ignored (:data:`partir_emu.mpi.interrupts.IGNORED_AT_START`). The shim execs, so
    the pid is ``argv``'s own."""
    shim = ("import os, signal, sys\n"
            "for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
            "    signal.signal(s, signal.SIG_DFL)\n"
            "os.execv(sys.argv[1], sys.argv[1:])")
    return [sys.executable, "-c", shim, *map(str, argv)]


def wall(seconds: float) -> float:
    """A wall-clock limit for a test marked ``wallclock``: ``seconds`` on a quiet machine, with slack."""
    return seconds * WALL_SLACK


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


@functools.cache
def _base_experiment(scenario: str, preset: str | None, overrides: str | None, strict: bool):
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    return Experiment(scenario, "bp", Mesh(batch=1), preset, overrides, strict=strict)


def experiment(scenario: str, strategy: str, mesh: str, preset: str | None = None, overrides: str | None = None,
               strict: bool = False):
    """An Experiment whose step is traced (and jitted) once per configuration in this process, shared
    by every strategy and mesh of it (Experiment.with_strategy)."""
    from partir_emu.core.mesh import Mesh
    return _base_experiment(scenario, preset, overrides, strict).with_strategy(strategy, Mesh.parse(mesh))


def assert_schedule_refused(overrides: str, strategy: str, mesh: str, needle: str) -> None:
    """A transformer configuration (tiny) and strategy that must be refused, when the schedule is
    made, with a ScenarioError whose message matches ``needle``."""
    from partir_emu.app.experiment import Experiment
    from partir_emu.core.mesh import Mesh
    from partir_emu.errors import ScenarioError
    with pytest.raises(ScenarioError, match=needle):
        assert not Experiment("transformer", strategy, Mesh.parse(mesh), "tiny", overrides).schedule


def verified_on_local_mesh(exp):
    """``exp`` lowered and run on the in-process LocalMesh: (SpmdProgram, Verdict against jax.jit)."""
    from partir_emu.runtime.local_mesh import LocalMesh
    spmd = exp.lower().spmd
    inputs = exp.inputs(spmd.input_names)
    return spmd, exp.check(LocalMesh(exp.mesh).run(spmd, inputs).outputs, inputs, spmd.output_names)


@functools.cache
def _programs():
    from partir_emu.app.programs import ProgramCache
    return ProgramCache(os.environ.get(PROGRAMS_ENV))


@functools.cache
def lowered(scenario: str, strategy: str, mesh: str, overrides: str | None = None):
    """(Experiment, SpmdProgram), lowered once per session: the workers and their child processes
    share one program cache on disk (``partir_emu.app.programs``, keyed by everything that shapes
    the program)."""
    exp = experiment(scenario, strategy, mesh, None, overrides)
    return exp, _programs().spmd(exp)


_RNG_STATES: dict[str, dict] = {}


@pytest.fixture(autouse=True)
def _module_rng_restored(request: pytest.FixtureRequest) -> None:
    """A test module's ``RNG = np.random.default_rng(seed)`` starts every test where it stood when the
    module's first test began: the inputs a test draws must not depend on which tests an xdist worker
    happened to run before it (they did: the same test got other inputs run to run)."""
    mod = request.module
    rng = getattr(mod, "RNG", None)
    if not isinstance(rng, np.random.Generator):
        return
    state = _RNG_STATES.setdefault(mod.__name__, rng.bit_generator.state)
    fresh = np.random.default_rng()
    fresh.bit_generator.state = state
    mod.RNG = fresh
