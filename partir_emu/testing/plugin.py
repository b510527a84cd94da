"""The pytest plugin (entry point ``pytest11: partir_emu = partir_emu.testing.plugin``): installed
with the package, active in every pytest run, costing nothing until a test asks for it.

* ``--partir-update-baselines``: rewrite the baseline files the tests check instead of checking
  them (then review the diff in git);
* fixture ``partir_baseline``: a :class:`~partir_emu.app.claims.baselines.Baselines` for the test,
  its files in ``baselines/<test module>/`` next to the test file, one per test (and per name
  given to ``check``);
* the terminal summary lists the baseline files a run wrote.

Predictions and assertions are plain functions (``from partir_emu.testing import predict,
assert_faster, ...``); they work without pytest too.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from partir_emu.app.claims.baselines import Baselines

UPDATE_FLAG = "--partir-update-baselines"
_WRITTEN = pytest.StashKey[list]()


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("partir-emu", "partir-emu predictability claims")
    group.addoption(UPDATE_FLAG, action="store_true", default=False,
                    help="write the partir_baseline snapshots instead of checking them (review the diff)")


def pytest_configure(config: Any) -> None:
    config.stash[_WRITTEN] = []


@pytest.fixture
def partir_baseline(request: Any) -> Any:
    """The test's baselines: ``partir_baseline.check(predict(...))``."""
    test_file = Path(str(request.node.path))
    b = Baselines(test_file.parent / "baselines" / test_file.stem, request.node.name,
                  update=bool(request.config.getoption(UPDATE_FLAG)))
    yield b
    request.config.stash[_WRITTEN].extend(b.written)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    written = config.stash.get(_WRITTEN, [])
    if written:
        terminalreporter.section("partir-emu baselines")
        for p in written:
            terminalreporter.write_line(f"wrote {p}")
