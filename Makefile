# specrun: `make run` and `make test` each do their own set-up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PAIR   ?= smollm2-135m
PROMPT ?= examples/prompt.txt
N      ?= 256
GPU    ?=
PYTEST_ARGS ?=

LLAMA_CPP_PIN := llama-cpp-python==0.3.36
ifeq ($(GPU),cuda)
  CMAKE_ARGS := -DGGML_CUDA=on
else ifeq ($(GPU),metal)
  CMAKE_ARGS := -DGGML_METAL=on
else ifneq ($(GPU),)
  $(error GPU must be cuda or metal, got '$(GPU)')
endif

STAMP := $(VENV)/.installed$(if $(GPU),-$(GPU),)

.PHONY: install run test lint bench clean help
help:
	@echo "make run     - generate on the default pair with speculation (PROMPT=file.txt, N=tokens)"
	@echo "make test    - the whole test suite"
	@echo "make install - .venv with specrun and the default model pair (GPU=cuda|metal)"
	@echo "make lint    - ruff + mypy"
	@echo "make bench   - the built-in benchmark suite on the default pair"

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifneq ($(GPU),)
	@echo "building llama-cpp-python with CMAKE_ARGS=$(CMAKE_ARGS) (several minutes)"
	CMAKE_ARGS="$(CMAKE_ARGS)" $(BIN)/python -m pip install --force-reinstall --no-cache-dir --no-deps "$(LLAMA_CPP_PIN)"
endif
	@echo "installing specrun and its pinned dependencies (llama-cpp-python builds from source: ~7 min on 2 cores, once)"
	$(BIN)/python -m pip install --quiet -e '.[dev,plot]'
	$(BIN)/specrun models pull $(PAIR)
	touch $@

run: install
	$(BIN)/specrun generate --pair $(PAIR) -p $(PROMPT) -n $(N) --compare --stats

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy src/specrun

# Sized to finish in under 10 minutes on 2 CPU cores for the default pair.
bench: install
	$(BIN)/specrun bench --pair $(PAIR) --suite builtin --limit 1 -n 96 --repeats 2 \
	  --modes none,draft,lookup,hybrid,auto --draft-max 2,4,8 \
	  --json bench/latest.json --md bench/latest.md --plot bench/latest.png

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
