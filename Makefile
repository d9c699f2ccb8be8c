# Two commands for a fresh machine: `make train` and `make test`. Both build .venv from the pinned lock first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/base.yaml
ARGS ?=
export JAX_PLATFORMS ?= cpu
export TPU_ACCELERATOR_TYPE ?= v5litepod-4
export TPU_WORKER_HOSTNAMES ?= localhost
export ALLOW_MULTIPLE_LIBTPU_LOAD ?= 1

.PHONY: train test lint venv clean-venv

$(STAMP): requirements/cpu.lock pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.lock
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(PY) train.py --config $(CONFIG) $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

test: lint
	$(PY) -m pytest -n 2 --dist loadgroup -q $(ARGS)

clean-venv:
	rm -rf $(VENV)
