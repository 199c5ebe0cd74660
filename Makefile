# The two commands of the quick start are `make run` and `make test`; both build .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Pinned so pip takes the local CPU build instead of a multi-GB CUDA wheel.
TORCH_PIN := torch==2.13.0
# Where pip gets torch; empty: the default index. Where the default wheel is the CUDA one (Linux
# x86_64 on PyPI), `make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu` takes the CPU build.
TORCH_INDEX_URL ?=
PYTEST_ARGS ?=
PYTEST_PARALLEL ?= -n 6 --dist loadfile
# System tools some tests need, from Debian packages: promtool and prometheus (tests/dashboards),
# chromium (the status page test, tests/daemon/test_status_page.py), systemd-analyze (the unit
# file test), tmux (the live status line test, tests/daemon/agent/test_progress.py), etcd (the
# etcd-v2 rendezvous tests, tests/daemon/agent/test_rdzv_etcd.py; each starts its own on loopback).
SYSTEM_TOOLS := promtool prometheus chromium systemd-analyze tmux etcd
SYSTEM_PACKAGES := prometheus chromium systemd tmux etcd-server

.PHONY: venv system-tools stop-packaged-services run test lint format clean bench device-wheels

venv: $(STAMP)

# The C helper is built by the (editable) install, so a change to it reinstalls.
$(STAMP): pyproject.toml ckpt_manager/_save/_streaming_copy.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(TORCH_PIN)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

# The packages the device machine's image lacks (it has torch, numpy, fsspec, prometheus-client
# and rich; s3fs is imported only for s3:// roots), as wheels for its Python 3.12 on x86-64, at
# the versions this venv holds: a device run carries `.whl` (BENCHMARKS.md, "The next device run").
DEVICE_WHEELS := structlog isal crc32c
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64

device-wheels: venv
	rm -rf .whl && mkdir .whl
	for p in $(DEVICE_WHEELS); do \
		v=$$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$$p'))") || exit 1; \
		$(BIN)/python -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
			--python-version 3.12 --implementation cp $(addprefix --platform ,$(DEVICE_PLATFORMS)) \
			-d .whl "$$p==$$v" || exit 1; \
	done
	ls .whl

run: venv
	$(BIN)/trainingd run $(RUN_ARGS)

# Installs the missing system tools when it can (root and apt-get, as on CI); otherwise it says
# why in one line and carries on: the tests that need them skip with that reason, and fail instead
# under STRICT_SYSTEM_TOOLS=1 or CI=true (tests/conftest.py), as .ci/run sets.
system-tools:
	@missing=; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null 2>&1 || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	why=; \
	if [ "$$(id -u)" != 0 ]; then why="not root"; \
	elif ! command -v apt-get >/dev/null 2>&1; then why="no apt-get"; \
	else \
	  export DEBIAN_FRONTEND=noninteractive; \
	  if apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); then \
	    $(MAKE) --no-print-directory stop-packaged-services; exit 0; \
	  fi; why="apt-get install failed"; \
	fi; \
	echo "system-tools: missing$$missing and cannot install $(SYSTEM_PACKAGES) ($$why): the tests that need them will skip (run as root with apt-get to install)"

# The package starts a service on install where an init system runs; the tests start their own
# server on a free loopback port, so stop the packaged one (by its service, not by name).
stop-packaged-services:
	@if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet prometheus 2>/dev/null; then \
	  systemctl stop prometheus; \
	elif [ -x /etc/init.d/prometheus ]; then \
	  /etc/init.d/prometheus stop >/dev/null 2>&1 || true; \
	fi
	@if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet etcd 2>/dev/null; then \
	  systemctl stop etcd; \
	elif [ -x /etc/init.d/etcd ]; then \
	  /etc/init.d/etcd stop >/dev/null 2>&1 || true; \
	fi

# Two parts: the suite on 6 workers, then the `serial` tests alone (they judge timing from
# outside and must not share the machine with another file's daemons). Exit code 5 (nothing
# collected, e.g. a PYTEST_ARGS subset without serial tests) is not a failure.
test: venv system-tools
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
