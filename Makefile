# Quickstart targets: `make demo` (set up + run the main job) and `make test` (set up + full suite).
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: setup demo test
setup:
	scripts/setup_env.sh
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "is ignored" || true

demo: setup
	$(VENV)/bin/dllm demo

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)
