# Every target creates .venv and installs what it needs; torch is pinned to the CPU build by
# constraints.txt so that no CUDA wheels are pulled.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: serve test bench lint format clean redis-server chromium

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test,bench,ray,otel,accel]"
	touch $@

serve: $(STAMP)
	$(VENV)/bin/omni-runtime serve

# The job tests start a private redis-server (Debian's package); serve needs it only with --redis-url.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server; }

# The page tests drive Debian's Chromium through its chromedriver (both paths given to Selenium, which
# then downloads nothing).
chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; }

# Two pytest-xdist workers, a test file each at a time (module-scoped engines stay in one worker):
# most tests wait on processes, sockets and leases, so two overlap well on two cores. Files go out
# longest first (tests/conftest.py, HEAVIEST_FILES), so that no long file starts last. The slowest
# tests are listed at the end, so that a run says where the suite's time goes.
TEST_WORKERS ?= 2
# The type check runs beside the tests (the two workers leave about half a core idle while they
# wait on processes and sockets); the target fails if either fails.
test: $(STAMP) redis-server chromium
	$(PY) -m ruff check .
	$(PY) -m mypy & mypy=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS); rc=$$?; \
	wait $$mypy || rc=1; exit $$rc

bench: $(STAMP)
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.batching
	$(PY) -m benchmarks.step_batching
	$(PY) -m benchmarks.text_batching
	$(PY) -m benchmarks.adaptive_batching
	$(PY) -m benchmarks.video
	$(PY) -m benchmarks.audio
	$(PY) -m benchmarks.streaming --handoff
	$(PY) -m benchmarks.transfer
	$(PY) -m benchmarks.http
	$(PY) -m benchmarks.multimodel
	$(PY) -m benchmarks.jobs
	$(PY) -m benchmarks.acceleration

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: $(STAMP)
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache
