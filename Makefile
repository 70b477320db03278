# The two commands: `make demo` and `make test`. Both install into .venv first if needed.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup demo test unit lint e2e clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m kvpush.cli demo

test: setup lint
	$(PY) -m pytest -q -p no:cacheprovider --durations=25 tests

unit: setup
	$(PY) -m pytest -q tests/unit

e2e: setup
	$(PY) -m pytest -q tests/e2e

lint: setup
	$(PY) -m ruff check kvpush tests
	$(PY) -m mypy

clean:
	rm -rf .kvpush results
