# Every target creates .venv and installs what it needs; torch is pinned to the CPU build by
# constraints.txt so that no CUDA wheels are pulled.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test bench lint format clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,bench,ray]"
	touch $@

serve: $(STAMP)
	$(VENV)/bin/omni-runtime serve

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.batching
	$(PY) -m benchmarks.step_batching
	$(PY) -m benchmarks.transfer
	$(PY) -m benchmarks.http

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
