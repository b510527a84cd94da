# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
JOBS ?= 2

.PHONY: setup demo test test-all test-fast lint typecheck bench clean lock fresh-clone

# The exact environment CI passed with (requirements.lock, see tools/lock.py); pyproject.toml keeps
# the ranges for library users. --no-deps: nothing outside the lock is installed.
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$$(grep '^pip==' requirements.lock)"
	$(PY) -m pip install -q --no-deps -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) tools/lock.py check
	touch $@

setup: $(VENV)/.installed

demo: setup
	mkdir -p reports
	$(VENV)/bin/partir-emu run transformer --strategy bp+mp+z3 --mesh batch=4,model=2 \
		--backend mpi --devices 8 --devices-per-rank 2 --timeout 300 --report reports/demo-mpi.json
	$(VENV)/bin/partir-emu simulate transformer --size t32 --strategy z3 --mesh batch=256 \
		--hardware tpu-v4 --top 5 --report reports/demo-simulate.json

# CI's gate: the whole suite but the larger variants tests/extended.py lists (< 20 min on 2 cores)
test: setup
	$(PY) -m pytest -n $(JOBS) --dist loadgroup -q -p no:cacheprovider -m "not extended"

# everything, the extended variants too (about twice as long)
test-all: setup
	$(PY) -m pytest -n $(JOBS) --dist loadgroup -q -p no:cacheprovider

# the quick tier: tests/unit and tests/integration (docs/tests.md) without the many-seed sweeps and
# the slow tests; no MPI launches, no XLA child processes (< 3 min)
test-fast: setup
	$(PY) -m pytest -n $(JOBS) --dist loadgroup -q -p no:cacheprovider -m "not mpi and not xla and not sweep and not slow" \
		tests/unit tests/integration

lint: setup
	$(VENV)/bin/ruff check partir_emu scenarios tests benchmarks examples

typecheck: setup
	$(VENV)/bin/mypy

# regenerate requirements.lock from the pyproject ranges (a fresh venv; then commit it)
lock:
	$(PYTHON) tools/lock.py write

# the README's two commands on a fresh clone of HEAD, plain and under another BLAS kernel with load
fresh-clone:
	bash tools/fresh_clone.sh

clean:
	rm -rf $(VENV) reports .pytest_cache
