# Every target creates .venv and installs exactly the lock of this Python (locks/py3.11.txt,
# locks/py3.12.txt): the versions the suite passed with, whatever the index has released since.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
LOCK := locks/py$(PYVER).txt

.PHONY: serve test bench lint format clean redis-server chromium prometheus espeak-ng lock lock-check gpu-wheels

# 1) uv, at the locked version, by pip  2) exactly the lock, by uv (what an older lock installed and
# this one no longer names is removed), then the project, editable, built by the locked
# setuptools. torch's CPU build comes from pip's configured wheel folder (find-links), which
# tools/lock.py hands to uv; see README, "Packages".
$(STAMP): pyproject.toml $(wildcard $(LOCK))
	@test -f $(LOCK) || { echo "no lock for Python $(PYVER): locks/ has $$(ls locks/*.txt)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-deps $$(grep '^uv==' $(LOCK))
	$(PY) tools/lock.py sync
	touch $@

# A quick check (no install) that .venv holds exactly the lock: a package upgraded or added by
# hand fails the gate, named.
lock-check: $(STAMP)
	$(PY) tools/lock.py check

# Resolve pyproject.toml's ranges anew for every locked Python (uv, from binary wheels), then
# `make test` and commit the locks with the change.
lock: $(STAMP)
	$(PY) tools/lock.py compile

# The CPython 3.12 wheels a GPU machine lacks (tools/gpu/wheels.txt names them), at the versions of
# the 3.12 lock, into GPU_WHEELS_DIR, carried to that machine by the GPU kit (docs/benchmarks.md, "GPU").
GPU_WHEELS_DIR ?= .whl
gpu-wheels: $(STAMP)
	$(PY) tools/gpu/wheels.py --lock locks/py3.12.txt --names tools/gpu/wheels.txt --dest $(GPU_WHEELS_DIR)

serve: $(STAMP)
	$(VENV)/bin/omni-runtime serve

# The job tests start a private redis-server (Debian's package); serve needs it only with --redis-url.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q redis-server; }

# The bundled espeak config (omni-runtime serve espeak) and its tests run Debian's espeak-ng.
espeak-ng:
	@command -v espeak-ng >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q espeak-ng; }

# The page tests drive Debian's Chromium through its chromedriver (both paths given to Selenium, which
# then downloads nothing).
chromium:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q chromium chromium-driver; }

# The observability test runs its own Prometheus (Debian's package) on a free port and stops it by
# PID. The package enables a prometheus service: stopped and disabled at once, so that nothing is
# left scraping; without recommends, so no node exporter comes with it.
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
		$(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends prometheus && \
		if [ -d /run/systemd/system ]; then $(SUDO) systemctl disable --now prometheus; \
		else $(SUDO) /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi; }

# Two pytest-xdist workers, a test file each at a time (module-scoped engines stay in one worker):
# most tests wait on processes, sockets and leases, so two overlap well on two cores. Files go out
# longest first (tests/conftest.py, HEAVIEST_FILES), so that no long file starts last. The slowest
# tests are listed at the end, so that a run says where the suite's time goes.
TEST_WORKERS ?= 2
# The type check runs beside the tests (the two workers leave about half a core idle while they
# wait on processes and sockets), at the lowest priority: a cold mypy takes a core for a minute or
# more, and beside the first, heaviest files (Ray clusters, CLI processes) at equal priority it
# slowed a Ray actor's start past its wait and a CLI's exit past its test's bound. The target
# fails if either fails.
# So does the check that the CPython 3.12 lock still resolves from binary wheels (that Python is not
# on these machines; tools/lock.py verify): it waits on the package index, not on a core.
test: $(STAMP) lock-check redis-server chromium prometheus espeak-ng
	$(PY) -m ruff check .
	nice -n 19 $(PY) -m mypy & mypy=$$!; \
	nice -n 19 $(PY) tools/lock.py verify 3.12 & verify=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS); rc=$$?; \
	wait $$mypy || rc=1; wait $$verify || rc=1; exit $$rc

bench: $(STAMP)
	$(PY) -m benchmarks.overhead
	$(PY) -m benchmarks.batching
	$(PY) -m benchmarks.step_batching
	$(PY) -m benchmarks.text_batching
	$(PY) -m benchmarks.adaptive_batching
	$(PY) -m benchmarks.slo run
	$(PY) -m benchmarks.video
	$(PY) -m benchmarks.audio
	$(PY) -m benchmarks.streaming --handoff
	$(PY) -m benchmarks.realtime
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
