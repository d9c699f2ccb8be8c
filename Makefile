# Two commands for a fresh machine: `make train` and `make test`. Both build a virtual environment from the
# pinned lock of the machine's platform first.
#
# Platform (override with PLATFORM=cpu|cuda|tpu):
#   cuda  `nvidia-smi -L` lists a GPU          -> .venv-cuda from requirements/cuda.lock (Python 3.12, JAX 0.11)
#   tpu   a TPU VM (/dev/accel*, /dev/vfio/N, or TPU_ACCELERATOR_TYPE set by the VM)
#                                              -> .venv-tpu from requirements/tpu.lock (Python 3.12, JAX 0.11)
#   cpu   anything else (CI)                   -> .venv from requirements/cpu.lock (Python 3.11, JAX 0.10.2 with
#         libtpu: the tests compile TPU programs, so only here JAX is forced onto the CPU and given a fake TPU
#         topology)
# `make test` runs the platform's tests: on cpu the suite without the extended tests (2 workers); on cuda the
# tests marked gpu, on the GPU (one worker: the processes would share the GPU); on tpu the suite on the TPU (one
# worker: a TPU belongs to one process). TEST_MARKERS=... and TEST_WORKERS=... override (docs/testing.md).
# PYTHON=... picks another interpreter for the platform's venv, LOCK=... another lock.
ifeq ($(origin PLATFORM),undefined)
  ifneq ($(shell nvidia-smi -L >/dev/null 2>&1 && echo yes),)
    PLATFORM := cuda
    PLATFORM_WHY := nvidia-smi lists a GPU
  else ifneq ($(wildcard /dev/accel* /dev/vfio/[0-9]*)$(TPU_ACCELERATOR_TYPE),)
    PLATFORM := tpu
    PLATFORM_WHY := TPU devices or TPU_ACCELERATOR_TYPE found
  else
    PLATFORM := cpu
    PLATFORM_WHY := no GPU or TPU found
  endif
else
  PLATFORM_WHY := set by PLATFORM=$(PLATFORM)
endif

ifeq ($(PLATFORM),cpu)
  PYTHON ?= python3.11
  VENV := .venv
  export JAX_PLATFORMS ?= cpu
  export TPU_ACCELERATOR_TYPE ?= v5litepod-4
  export TPU_WORKER_HOSTNAMES ?= localhost
  export ALLOW_MULTIPLE_LIBTPU_LOAD ?= 1
  TEST_MARKERS ?= not extended
  TEST_WORKERS ?= 2
else ifneq ($(filter $(PLATFORM),cuda tpu),)
  PYTHON ?= python3.12
  VENV := .venv-$(PLATFORM)
  TEST_WORKERS ?= 1
  ifeq ($(PLATFORM),cuda)
    TEST_MARKERS ?= gpu and not extended
  else
    TEST_MARKERS ?= not extended
  endif
else
  $(error PLATFORM=$(PLATFORM) is not one of: cpu, cuda, tpu)
endif

LOCK ?= requirements/$(PLATFORM).lock
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/base.yaml
ARGS ?=

$(info mixerlab: platform $(PLATFORM) ($(PLATFORM_WHY)); venv $(VENV) from $(LOCK))

.PHONY: train test test-all lint venv clean-venv locks

$(STAMP): $(LOCK) pyproject.toml setup.py
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	@touch $(STAMP)

venv: $(STAMP)

train: $(STAMP)
	$(PY) train.py --config $(CONFIG) $(ARGS)

# ruff, then basedpyright (pyproject.toml's [tool.basedpyright]): fails on any import it cannot resolve, over every
# Python file of the repository, against this venv's packages.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m basedpyright --pythonpath $(PY)

# the tests on a GPU/TPU host: its platform first (tests/conftest.py picks the same when JAX_PLATFORMS is unset)
ifneq ($(PLATFORM),cpu)
test test-all: export JAX_PLATFORMS ?= $(PLATFORM),cpu
endif

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q --durations=25 -m "$(TEST_MARKERS)" $(ARGS)

test-all: lint  # make test plus the tests marked extended (larger shapes and variants; ~2x the time)
	MIXERLAB_TEST_ALL=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup -q --durations=25 \
	  $(if $(filter cuda,$(PLATFORM)),-m gpu) $(ARGS)

clean-venv:
	rm -rf $(VENV)

# Regenerates the three locks with uv's resolver from pyproject.toml's extras plus requirements/<platform>.in
# (the JAX line of each). Versions already in a lock are kept unless something forces a change; pass
# UPGRADE=--upgrade to move everything to the newest allowed. Each lock's header repeats its command.
EXTRAS := --extra cloud --extra tracking --extra data --extra eval --extra dev
UV_COMPILE = $(PY) -m uv pip compile pyproject.toml --python-platform x86_64-manylinux_2_31 $(EXTRAS) $(UPGRADE) -q
locks: $(STAMP)
	@$(PY) -m uv --version >/dev/null 2>&1 || $(PY) -m pip install -q uv
	@for p in cuda tpu; do test -f requirements/$$p.lock || cp requirements/cpu.lock requirements/$$p.lock; done
	$(UV_COMPILE) requirements/cpu.in --extra tpu --python-version 3.11 -o requirements/cpu.lock
	$(UV_COMPILE) requirements/cuda.in --extra cuda --python-version 3.12 -o requirements/cuda.lock
	$(UV_COMPILE) requirements/tpu.in --extra tpu --python-version 3.12 -o requirements/tpu.lock
