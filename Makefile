# Two entry points: `make demo` (train the MNIST quick start) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: demo test lint bench clean

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

test: $(VENV)/.dev
	$(PY) -m pytest -q

# Side-by-side benchmarks (benchmarks/README.md); e.g. make bench BENCH_ARGS="--quick --record"
BENCH_ARGS ?=
bench: $(VENV)/.dev
	$(PY) benchmarks/run.py --out runs/bench/bench.json $(BENCH_ARGS)

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check src tests examples

clean:
	rm -rf $(VENV) runs .pytest_cache
