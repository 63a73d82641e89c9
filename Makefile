# Two entry points for a fresh machine: `make run` and `make test`. Both start with `make install`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3
# Some package mirrors print one warning per package; keep the install log readable.
QUIET_PIP := sed -u '/is ignored: it is neither a file nor a directory/d'

.PHONY: install run test test-fast test-all test-ray-oldest lint bench debs browser slurm check mlflow clean docs

install: $(STAMP)

# CPU installs pin torch through constraints-cpu.txt: an unpinned torch pulls several GB of CUDA wheels.
# uv installs the same versions as pip in ~10 s where pip takes ~2 min (measured on 2 cores). It does
# not read pip's configuration, so it gets pip's find-links, where this machine keeps its CPU torch
# wheel; where no such wheel is found (uv would fetch torch's CUDA build), pip installs as before.
FIND_LINKS = $(sort $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS))
CPU_TORCH = $(firstword $(foreach d,$(FIND_LINKS),$(wildcard $(d)/torch-*+cpu-*.whl)))
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if [ -n "$(CPU_TORCH)" ] && $(PY) -m pip install -q uv 2>&1 | $(QUIET_PIP) && [ -x $(VENV)/bin/uv ]; then \
	  $(VENV)/bin/uv pip install -q --python $(PY) $(addprefix --find-links ,$(FIND_LINKS)) -c constraints-cpu.txt -e '.[dev]'; \
	else \
	  $(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]' 2>&1 | $(QUIET_PIP); \
	fi
	touch $@

# Bytecode is written as modules are first imported, whatever the caller's PYTHONDONTWRITEBYTECODE
# (set on some machines, CI's among them): with it, each of the suite's hundreds of processes
# compiled torch, Ray and MLflow again (a fresh-clone make test took 50 min). Compiling all of
# site-packages at install instead (uv --compile-bytecode) cost 76 s of CPU, most of it on modules
# nothing imports; the first import of what the suite uses costs ~17 s, run beside the lint.
WRITE_BYTECODE = env -u PYTHONDONTWRITEBYTECODE
WARM_IMPORTS = import raylane.cli, raylane.driver, torch, torch.distributed.fsdp, mlflow, ray.train.torch, transformers, peft

run: install
	$(VENV)/bin/raylane train pipelines/digits.yaml --set scaling.num_workers=2
	@echo
	@echo "raylane is installed in $(VENV): run 'source $(VENV)/bin/activate' once in this shell, then the README's raylane commands work as written ('raylane --version' checks it)."

# Under 15 minutes on a fresh clone on 2 cores (measured in the closing notes). Two pytest-xdist
# workers: a test mostly waits (on Ray's start-up, a subprocess, a timeout), so one worker alone
# left the two cores part idle. Ray runs that need no cluster of their own (tests marked
# shared_ray) share one `raylane up` head across both workers; the end-to-end tests go first and
# the unit tests fill the end. `make test XDIST=` runs in one process. `make test-all` adds the
# `slow` soaks (the quick bench).
XDIST = -n 2
test: install debs
	$(WRITE_BYTECODE) $(PY) -c "$(WARM_IMPORTS)" >/dev/null 2>&1 & warm=$$!; \
	$(MAKE) --no-print-directory lint; wait $$warm || true
	$(WRITE_BYTECODE) $(VENV)/bin/pytest tests/e2e tests/unit $(XDIST) -m "not slow and not gpu" --durations=25

# The unit tests alone (no Ray, no subprocess; under two minutes): the first feedback on a change.
test-fast: install
	$(WRITE_BYTECODE) $(VENV)/bin/pytest tests/unit -q

# Lint, format and types: no new finding may land (scripts/typecheck.py keeps mypy's baseline).
lint: install
	$(VENV)/bin/ruff check app scripts tests pipelines
	$(VENV)/bin/ruff format --check app scripts tests pipelines
	$(PY) scripts/typecheck.py

test-all: install debs
	$(WRITE_BYTECODE) $(VENV)/bin/pytest tests $(XDIST) -m "not gpu" --durations=15

# The oldest Ray the dependency allows (pyproject.toml: ray>=2.59,<2.61), in an environment of its
# own: the Ray internals' check and every test that starts or joins a Ray cluster (not the soaks).
RAY_OLDEST = 2.59.0
OLDEST = .venv-ray-oldest
test-ray-oldest: browser
	test -x $(OLDEST)/bin/python || $(PYTHON) -m venv $(OLDEST)
	if [ -n "$(CPU_TORCH)" ] && $(OLDEST)/bin/python -m pip install -q uv 2>&1 | $(QUIET_PIP) && [ -x $(OLDEST)/bin/uv ]; then \
	  $(OLDEST)/bin/uv pip install -q --compile-bytecode --python $(OLDEST)/bin/python $(addprefix --find-links ,$(FIND_LINKS)) -c constraints-cpu.txt -e '.[dev]' 'ray[default,data,train,tune]==$(RAY_OLDEST)'; \
	else \
	  $(OLDEST)/bin/python -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]' 'ray[default,data,train,tune]==$(RAY_OLDEST)' 2>&1 | $(QUIET_PIP); \
	fi
	$(OLDEST)/bin/python -c "import ray; assert ray.__version__ == '$(RAY_OLDEST)', ray.__version__"
	$(OLDEST)/bin/pytest tests/unit/test_ray_internals.py tests/e2e/test_versions.py
	$(OLDEST)/bin/pytest tests $(XDIST) -m "(ray or shared_ray) and not slow and not gpu" --durations=15

# B1-B9 against hand-written torchrun DDP and plain Ray Tune: bench/results.json, results.md and
# charts (about an hour on 2 cores). `raylane bench --quick` checks the harness in a few minutes.
bench: install
	$(VENV)/bin/raylane bench --out bench

# Debian's packages the suite drives, in one apt run: chromium for the MLflow UI test (Playwright
# drives it; nothing is downloaded by Playwright itself) and slurm-wlm (slurmctld, slurmd, munge)
# for the Slurm tests, each of which starts a one-node cluster of its own in a temporary folder and
# stops it (tests/helpers/slurm.py). Needs root or passwordless sudo; without it, those tests are
# skipped, naming why. `make browser` and `make slurm` install one of them.
DEBS = chromium:chromium slurmctld:slurm-wlm
debs:
	@missing=$$(for d in $(DEBS); do command -v $${d%%:*} >/dev/null || echo $${d#*:}; done); \
	[ -z "$$missing" ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo "sudo -n" ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	} || echo "warning: could not install Debian's $$(echo $$missing): the tests that need them will be skipped"
browser:
	@$(MAKE) --no-print-directory debs DEBS=chromium:chromium
slurm:
	@$(MAKE) --no-print-directory debs DEBS=slurmctld:slurm-wlm

# A tracking server on 127.0.0.1:5000 (sqlite, artifacts served through it); see the script.
mlflow: install
	scripts/mlflow-server.sh

check: install
	$(VENV)/bin/raylane check pipelines/digits.yaml

clean:
	rm -rf $(VENV) $(OLDEST) runs mlflow.db mlflow.db.lock mlartifacts mlflow-server test-artifacts .pytest_cache

# The pages generated from the code: docs/summary.md and docs/summary.schema.json (app/raylane/results.py),
# and docs/configuration.md (the config models). tests/unit/test_results.py and tests/unit/test_config_docs.py
# fail when the committed ones differ.
docs: install
	$(PY) scripts/summary_docs.py
	$(PY) scripts/config_docs.py
