# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
JOBS ?= 2

.PHONY: setup demo test test-fast lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	mkdir -p reports
	$(VENV)/bin/partir-emu run transformer --strategy bp+mp+z3 --mesh batch=4,model=2 \
		--backend mpi --devices 8 --devices-per-rank 2 --timeout 300 --report reports/demo-mpi.json
	$(VENV)/bin/partir-emu simulate transformer --size t32 --strategy z3 --mesh batch=256 \
		--hardware tpu-v4 --top 5 --report reports/demo-simulate.json

test: setup
	$(PY) -m pytest -n $(JOBS) -q -p no:cacheprovider

test-fast: setup
	$(PY) -m pytest -n $(JOBS) -q -m "not mpi and not slow"

lint: setup
	$(VENV)/bin/ruff check partir_emu scenarios tests benchmarks examples

typecheck: setup
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) reports .pytest_cache
