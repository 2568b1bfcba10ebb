# specrun: `make run` and `make test` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PAIR   ?= smollm2-135m
PROMPT ?= examples/prompt.txt
N      ?= 256
GPU    ?=
PYTEST_ARGS ?=

# The llama-cpp-python release the patched build takes: patches/PIN, read here, by
# scripts/build-llama.sh and by the tests (pyproject.toml only bounds what specrun runs on).
LLAMA_CPP_VERSION := $(shell cat patches/PIN)
LLAMA_CPP_PIN := llama-cpp-python==$(LLAMA_CPP_VERSION)
# GGML_LLAMAFILE=ON, with patches/ (sgemm-prompts, sgemm-by-pass): llamafile's tinyBLAS sums a
# row otherwise than the kernels a single row takes, so it may only take a prompt's passes
# (computed alike whether or not a run speculates), where it is fast (F16 and F32 prompts
# 1.1-1.6x). Verify passes and single rows take ggml's own kernels, row-exact: a row
# verified among K+1 gets the logits it gets alone, bit for bit (README.md, "Install it your way").
# GGML_RPC=ON: llama.cpp's RPC backend, for `specrun worker` and `--rpc` (README.md, "Across
# machines").
LLAMA_CMAKE := -DGGML_LLAMAFILE=ON -DGGML_RPC=ON
ifeq ($(GPU),cuda)
  CMAKE_ARGS := $(LLAMA_CMAKE) -DGGML_CUDA=on
else ifeq ($(GPU),metal)
  CMAKE_ARGS := $(LLAMA_CMAKE) -DGGML_METAL=on
else ifeq ($(GPU),)
  CMAKE_ARGS := $(LLAMA_CMAKE)
else
  $(error GPU must be cuda or metal, got '$(GPU)')
endif
# patches/ changes the vendored llama.cpp (row-exact batched Q8_0, Q4_K, Q6_K and F16 kernels; a
# compute graph kept per batch size, computed without the scheduler once placed; the --draft-p-min
# check in C; AMX's tile configuration loaded whole; a few rows of Q8_0 / Q4_0 / Q4_1 / K-quants
# on AMX weights by the one-row kernels' arithmetic; Q5_0 by AVX512-VNNI; weight rows fetched
# ahead of a single row's quantized matmul on Intel; a few rows split among the threads as one
# is, and a single F16 row by the multi-column kernel; llamafile's sgemm on prompts only),
# applied in patches/series' order (each patch's purpose, tests and CPU features are noted
# there): a new patch, or another order, rebuilds.
PATCHES := $(addprefix patches/,$(shell sed -e '/^[[:space:]]*\#/d' -e '/^[[:space:]]*$$/d' patches/series))
PATCHES_SUM := $(shell cat $(PATCHES) | cksum | cut -d' ' -f1)
LLAMA_BUILD := $(LLAMA_CPP_PIN) CMAKE_ARGS=$(CMAKE_ARGS) patches=$(PATCHES_SUM)

STAMP := $(VENV)/.installed$(if $(GPU),-$(GPU),)
DEPS  := $(VENV)/.deps$(if $(GPU),-$(GPU),)

.PHONY: install run test test-fast lint bench clean help patches-check
help:
	@echo "make run     - generate on the default pair with speculation (PROMPT=file.txt, N=tokens)"
	@echo "make test    - the whole test suite"
	@echo "make test-fast - the tests that load no model (~75 s on 2 cores; no model is pulled)"
	@echo "make install - .venv with specrun and the default model pair (GPU=cuda|metal)"
	@echo "make lint    - ruff check, ruff format --check, mypy (strict on decoding/ and llama/)"
	@echo "make bench   - the built-in benchmark suite on the default pair"
	@echo "make patches-check VERSION=x.y.z - whether patches/series applies to that llama-cpp-python"

install: $(STAMP)

# The environment without the models: what test-fast and lint need.
$(DEPS): pyproject.toml Makefile patches/PIN patches/series $(PATCHES) scripts/build-llama.sh scripts/patches.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# llama-cpp-python ships as source only: built here from its sdist with our patches and CMake
	@# flags (no cached wheel, which may lack them), again only when the pin, flags or patches change.
	@if [ "$$(cat $(VENV)/.llama-build 2>/dev/null)" != "$(LLAMA_BUILD)" ]; then \
	  echo "building $(LLAMA_CPP_PIN) with patches/ and CMAKE_ARGS='$(CMAKE_ARGS)' (~7 min on 2 cores, once)"; \
	  CMAKE_ARGS="$(CMAKE_ARGS)" sh scripts/build-llama.sh $(BIN)/python \
	    && echo "$(LLAMA_BUILD)" > $(VENV)/.llama-build; \
	fi
	@echo "installing specrun and its pinned dependencies"
	$(BIN)/python -m pip install --quiet -e '.[dev,plot]'
	touch $@

$(STAMP): $(DEPS)
	$(BIN)/specrun models pull $(PAIR)
	touch $@

run: install
	$(BIN)/specrun generate --pair $(PAIR) -p $(PROMPT) -n $(N) --compare --stats

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(DEPS)
	$(BIN)/python -m pytest -q -m "not models and not slow" $(PYTEST_ARGS)

lint: $(DEPS)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy src/specrun
	$(BIN)/mypy --strict src/specrun/decoding src/specrun/llama

# Sized to finish in under 10 minutes on 2 CPU cores for the default pair.
bench: install
	$(BIN)/specrun bench --pair $(PAIR) --suite builtin --limit 1 -n 96 --repeats 2 \
	  --modes none,draft,lookup,hybrid,auto --draft-max 2,4,8 \
	  --json docs/results/latest.json --md docs/results/latest.md --plot docs/results/latest.png

# Downloads VERSION's source release and tries patches/series on it in order (git apply --check),
# building nothing: which patches no longer apply (exit 1 if any). VERSION defaults to the pin.
VERSION ?= $(LLAMA_CPP_VERSION)
patches-check:
	PYTHON=$(PYTHON) sh scripts/patches-check.sh $(VERSION)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
