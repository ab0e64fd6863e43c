# Two entry points for a fresh Debian 12 machine: `make run` and `make test`.
# Each creates .venv, installs the project with its pinned dependencies, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast test-docker clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: a local prefill + decode + gateway cluster on the embedded model pair.
run: $(STAMP)
	$(BIN)/scd-serve up

# The whole suite (unit, integration, e2e with real processes).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) build *.egg-info scd_serve/_proto
