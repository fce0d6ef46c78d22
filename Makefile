# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
# `make test` also builds the documentation site (tests/test_docs.py); `make docs` writes it to site/.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Each process of a multi-process CPU run uses one thread, so N processes fit on N cores.
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export PYTHONUNBUFFERED = 1

.PHONY: demo test test-lowest install bench docs clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/base.txt constraints/test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints/test.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

test: $(STAMP)
	$(PY) -m pytest tests

# The suite on the lowest supported Lightning (constraints/lowest.txt), a pure-Python install beside the pinned one.
LOWEST := .lowest
test-lowest: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(LOWEST) -c constraints/lowest.txt lightning
	PYTHONPATH=$(LOWEST):. $(PY) -m pytest tests

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints/bench.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(LOWEST) lightning_logs wandb out site .pytest_cache
