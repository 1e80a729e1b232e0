# Two entry points: `make demo` (train the MNIST quick start) and `make test` (the suite).
# While working: `make test-fast` (no slow or multi-device tests), `make lint` and `make docs`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test test-fast lint docs bench bench-serve mutants clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(VENV)/.examples: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e ".[examples]"
	touch $@

$(VENV)/.dev: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e ".[dev,examples]"
	touch $@

demo: $(VENV)/.examples
	$(PY) examples/mnist.py

# Both tiers run in WORKERS processes (pytest-xdist; a file's tests stay in one), which share
# the session's compilation cache. WORKERS=0: one process.
WORKERS ?= 2
XDIST = $(if $(filter 0,$(WORKERS)),,-n $(WORKERS) --dist loadfile)

# Every test (both tiers), as CI runs it; the aim is under 15 minutes on 2 idle cores.
test: $(VENV)/.dev
	$(PY) -m pytest -q $(XDIST)

# The fast tier, the loop while working: unit tests and the quick end-to-end runs, every test
# not marked slow or multi_device (the aim: under 3 minutes on 2 idle cores). An unmarked test
# that takes more than 5 CPU seconds fails (tests/README.md, "Tiers and timings").
test-fast: $(VENV)/.dev
	$(PY) -m pytest -q $(XDIST) -m "not slow and not multi_device"

$(VENV)/.bench: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e ".[dev,examples,bench]"
	touch $@

# Side-by-side benchmarks (benchmarks/README.md), PyTorch and Lightning included (the `bench`
# extra); e.g. make bench BENCH_ARGS="--quick --record"
BENCH_ARGS ?=
bench: $(VENV)/.bench
	$(PY) benchmarks/run.py --out runs/bench/bench.json $(BENCH_ARGS)

# jaxnitro serve against a hand-written server, and the 10,000-request soak (about 5 minutes)
bench-serve: $(VENV)/.dev
	$(PY) benchmarks/serve.py --out runs/bench/serve.json $(BENCH_ARGS)

# ruff (lint and format) everywhere; the type checker on the package only; the import
# contracts of pyproject.toml (the layers of docs/layout.md).
LINT_PATHS := src tests tools examples benchmarks
lint: $(VENV)/.dev
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy src
	$(VENV)/bin/lint-imports

$(VENV)/.docs: pyproject.toml | $(VENV)/bin/python
	$(PIP) install --quiet -e ".[docs]"
	touch $@

# The documentation site (mkdocs.yml, pages under docs/) into site/; --strict fails on a broken
# link, a page missing from the nav or a docstring reference that does not resolve.
docs: $(VENV)/.docs
	$(VENV)/bin/mkdocs build --strict

# Mutation testing (cosmic-ray) of compile/, run/setup/, checkpoint/, steps/ and dist/ against
# their fast tests: hours on 2 cores, so not part of CI. Reports and sessions in mutants/ (run
# it again to continue); scores in tests/README.md. One target: make mutants MUTANTS=resume
MUTANTS ?=
mutants: $(VENV)/.dev
	$(PY) tools/mutants.py $(MUTANTS)

clean:
	rm -rf $(VENV) runs site .pytest_cache .ruff_cache .mypy_cache mutants
