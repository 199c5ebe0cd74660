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

.PHONY: venv run test lint format clean bench

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check \
		$(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) $(TORCH_PIN)
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

run: venv
	$(BIN)/trainingd run $(RUN_ARGS)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: venv
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
