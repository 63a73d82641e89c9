# Two entry points for a fresh machine: `make run` and `make test`. Both start with `make install`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTHON ?= python3
# Some package mirrors print one warning per package; keep the install log readable.
QUIET_PIP := sed -u '/is ignored: it is neither a file nor a directory/d'

.PHONY: install run test check mlflow clean

install: $(STAMP)

# CPU installs pin torch through constraints-cpu.txt: an unpinned torch pulls several GB of CUDA wheels.
$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]' 2>&1 | $(QUIET_PIP)
	touch $@

run: install
	$(VENV)/bin/raylane train pipelines/digits.yaml --set scaling.num_workers=2

test: install
	$(VENV)/bin/pytest tests -m "not slow and not gpu"

# A tracking server on 127.0.0.1:5000 (sqlite, artifacts served through it); see the script.
mlflow: install
	scripts/mlflow-server.sh

check: install
	$(VENV)/bin/raylane check pipelines/digits.yaml

clean:
	rm -rf $(VENV) runs mlflow.db mlartifacts mlflow-server .pytest_cache
