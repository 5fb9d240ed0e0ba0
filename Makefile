# moeflow: `make run` (set up, fetch, run pretrain/tiny through a local Prefect deployment) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup run ui test check lint browser chaos big fuzz bench gpu-bundle gpu-check

$(BIN)/moeflow: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build is on local disk; an unpinned torch pulls a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-build-isolation --no-deps megablocks==0.10.0 stanford-stk==0.7.1
	touch $@

setup: $(BIN)/moeflow

run: setup
	$(BIN)/moeflow fetch tiny
	$(BIN)/moeflow up tiny

# `make run`, leaving the Prefect server (its UI on 127.0.0.1) and worker running: `moeflow down` stops them
ui: setup
	$(BIN)/moeflow fetch tiny
	$(BIN)/moeflow up tiny --keep

test: setup browser lint
	$(BIN)/moeflow fetch smoke
	$(BIN)/python -m pytest

# the slower tier: several runs, clusters (Ray, Dask) or training ranks at once; `.ci/run` runs it after `make test`
check: setup
	$(BIN)/moeflow fetch smoke
	$(BIN)/python -m pytest -m check

# ruff, then the contracts (pyproject.toml). A bare `lint-imports` in the checkout keeps both too, but grimp then
# misnames the namespace folder tokenize/, so cycles among its modules go unseen; read through a folder holding
# a link `moeflow` to this checkout, the graph names it moeflow.tokenize and the cycle contract covers it
lint: setup
	$(BIN)/ruff check .
	@mkdir -p $(VENV)/lint && ln -sfn $(CURDIR) $(VENV)/lint/moeflow
	PYTHONPATH=$(CURDIR)/$(VENV)/lint $(BIN)/lint-imports --no-cache

# Debian's chromium for the browser test in tests/test_e2e.py, where apt-get runs as root; elsewhere that test
# is skipped and says why
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1 || \
	    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; }; } || \
	  echo "chromium is not installed and cannot be here: the browser test will be skipped"

# fault tolerance: each stage and phase kills itself at named points and seeded fractions (core/faults.py),
# a rerun must give the uninterrupted run's artifacts; also with the store on a local S3 server
chaos: setup
	$(BIN)/moeflow fetch smoke
	$(BIN)/python -m pytest -m chaos -v tests/test_faults.py tests/test_objstore.py

# memory: a 2 GB generated source through every data stage to `mix`, and a 20 GB decompression bomb through
# ingest, in a 1.5 GiB memory cgroup
big: setup
	$(BIN)/moeflow fetch smoke
	$(BIN)/python -m pytest -m big -v tests/test_faults.py

# the ingest fuzz suite with a longer, random budget (`make test` runs 25 derandomised cases a property);
# a random hypothesis seed, printed before and (on failure) after: MOEFLOW_FUZZ_SEED=N replays a run
fuzz: setup
	@n=$${MOEFLOW_FUZZ_EXAMPLES:-400}; seed=$${MOEFLOW_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "make fuzz: $$n examples a property, seed $$seed"; \
	MOEFLOW_FUZZ_EXAMPLES=$$n MOEFLOW_FUZZ_RANDOM=1 $(BIN)/python -m pytest -v --hypothesis-show-statistics \
		--hypothesis-seed=$$seed tests/test_ingest_fuzz.py \
	|| { echo "make fuzz FAILED with seed $$seed; replay: MOEFLOW_FUZZ_SEED=$$seed MOEFLOW_FUZZ_EXAMPLES=$$n make fuzz"; exit 1; }

bench: setup
	@for b in benchmarks/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

# the GPU machine reaches no registry: `make gpu-bundle` (here, with the registries) fetches into .gpu-bundle/ the
# wheels for its Python that `make gpu-check` installs there, and the sources it builds (moe/gpu_bundle.py)
GPU_BUNDLE ?= .gpu-bundle
GPU_PYTHON ?= 3.12
gpu-bundle: setup
	$(BIN)/python -m moeflow.moe.gpu_bundle --out $(GPU_BUNDLE) --python $(GPU_PYTHON)

# the prepared GPU verification (moe/gpu_check.py), offline, in time-boxed tiers: one JSON line each, a summary
# last; without CUDA it says so. On the GPU machine: `make gpu-check` with .gpu-bundle/ carried. To rehearse it
# on the CPU: `make gpu-check GPU_ARGS="--device cpu --small"`. It runs no `make setup` (no registry there)
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_SITE ?= /tmp/moeflow-gpu/site
GPU_ARGS ?=
gpu-check:
	@mkdir -p /tmp/moeflow-gpu && ln -sfn $(CURDIR) /tmp/moeflow-gpu/moeflow
	PYTHONPATH=/tmp/moeflow-gpu$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m moeflow.moe.gpu_check \
		--bundle $(GPU_BUNDLE) --site $(GPU_SITE) $(GPU_ARGS)
