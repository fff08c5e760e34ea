# fedsim: `make demo` sets up .venv and runs the curious-server demo; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch: without an NVIDIA GPU (nvidia-smi), the CPU build of torch 2.13.0 that this kind of machine keeps on
# local disk (/opt/wheels): a 1.6 GB venv instead of 6 GB, and the suite about 100 s faster in all
# (docs/benchmarks.md, "The test suite's own time"); with one, the CUDA build 2.14.1 (pip's cap here).
# pyproject.toml states ranges only. Elsewhere: make TORCH_SPEC="torch" ...
TORCH_SPEC ?= $(if $(shell command -v nvidia-smi 2>/dev/null),torch==2.14.1,torch==2.13.0)
STAMP := $(VENV)/.fedsim-installed

.PHONY: setup demo test test-fast test-slow test-all lint bench results clean

# pip byte-compiles every file it installs, on one core; most of those files are never imported. Instead the
# install skips it and one import of the stack then writes the .pyc files of what the runs and tests use
# (about 20 s here, against 53 s to compile the whole venv: docs/benchmarks.md, "The test suite's own time").
# The recipes below may write .pyc files even where the shell sets PYTHONDONTWRITEBYTECODE (as this
# machine does): otherwise every new process (Ray actors, Flower's app processes, `fedsim` subprocesses)
# compiles the stack again, twice as slow to start.
unexport PYTHONDONTWRITEBYTECODE
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile $(TORCH_SPEC)
	$(PY) -m pip install -q --no-compile -e ".[dev]"
	$(PY) -c "import fedsim.app.cli, fedsim.app.runner, fedsim.app.client, flwr.simulation, ray, attacks, strategies, clients, channels, pytest, xdist"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fedsim run experiments/demo.toml --out runs/demo

# Two pytest-xdist workers; tests sharing a module-scoped fixture run on one of them (tests/conftest.py).
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=30

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup -m "not ray"

# Tests marked `slow` (full-length reproductions; `make test` and CI skip them): every experiment's quick
# variants, the full-budget attack-strength checks.
test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --slow -m slow

test-all: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --slow

lint: $(STAMP)
	$(VENV)/bin/ruff check fedsim strategies channels clients attacks experiments tests benchmarks scripts

bench: $(STAMP)
	$(PY) benchmarks/sim_overhead.py
	$(PY) benchmarks/attack_speed.py
	$(PY) benchmarks/compensation_cost.py
	$(PY) benchmarks/secagg_overhead.py

# Re-publish every experiment at its full scale, seeds 0, 1, 2 (hours on 2 cores: docs/results/README.md);
# from a clean commit. Interrupted, run it again: each experiment resumes from runs/results/NAME.
# JOBS=N runs each experiment's in-process runs on N worker processes (the same numbers, sooner).
JOBS ?= 1
results: $(STAMP)
	set -e; for e in $$($(VENV)/bin/fedsim experiment --list | cut -d' ' -f1); do \
		$(VENV)/bin/fedsim experiment $$e --out runs/results/$$e --publish docs/results --jobs $(JOBS); done

clean:
	rm -rf runs .pytest_cache
