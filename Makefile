# Quick start: `make demo` runs the demo job (colocar demo: training on 4 local sidecar hosts, one of
# them killed midway; DEMO_ARGS passes flags, e.g. DEMO_ARGS=--quick); `make test` runs the whole suite.
# Both create .venv at the repo root (Python 3.11+) and reuse it when it is up to date.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.colocar-installed
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8
export JAX_PLATFORMS ?= cpu
# pytest-xdist workers for `make test`: the suite waits on processes and events about half the time
TEST_WORKERS ?= 2

.PHONY: demo test lint docs bench clean

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "colocar needs Python 3.11+; set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[demo,test,docs]'
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/colocar demo $(DEMO_ARGS)

test: $(STAMP) lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(PY) -m ruff check colocar tests examples
	$(PY) -m mypy

bench: $(STAMP)
	$(VENV)/bin/colocar bench rpc --quick
	$(VENV)/bin/colocar bench transfer --quick
	$(VENV)/bin/colocar bench loader --quick
	$(VENV)/bin/colocar bench ckpt --quick
	$(VENV)/bin/colocar bench recovery --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache site
