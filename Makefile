# Two commands for a newcomer: `make demo` and `make test`. Both create .venv on first use.
# `make test` also builds the documentation site (tests/test_docs.py) and, where `chromium` is installed, opens every
# page in it headless (.ci/run installs Debian's `chromium` first); `make docs` writes the site to site/.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# Each process of a multi-process CPU run uses one thread, so N processes fit on N cores.
export OMP_NUM_THREADS ?= 1
export WANDB_MODE ?= offline
export WANDB_SILENT ?= true
export PYTHONUNBUFFERED = 1

.PHONY: demo test test-lowest install bench bench-full stress stress-torchft docs docs-serve clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints/base.txt constraints/test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints/test.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/quickstart.py

# Two pytest workers (pytest-xdist), each running whole files (`loadfile`: a module's fixtures run once): the
# multi-process tests spend much of their time in start-ups and paced steps, which the other worker fills.
TEST_JOBS ?= 2
TEST_ARGS := -n $(TEST_JOBS) --dist loadfile
test: $(STAMP)
	$(PY) -m pytest $(TEST_ARGS) tests

# The suite on the lowest supported Lightning (constraints/lowest.txt), a pure-Python install beside the pinned one.
LOWEST := .lowest
test-lowest: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --upgrade --target $(LOWEST) -c constraints/lowest.txt lightning
	PYTHONPATH=$(LOWEST):. $(PY) -m pytest $(TEST_ARGS) tests

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# The site at http://127.0.0.1:8000, rebuilt on every edit (`make docs` builds a copy that also works from disk).
docs-serve: $(STAMP)
	$(VENV)/bin/mkdocs serve

# The benchmarks' parts whose cached result is stale (benchmarks/run_all.py prints the plan and an estimate
# first); an interrupted run resumes, an unchanged part is not rerun. bench-full adds the research tables.
BENCH_ARGS ?=
bench: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints/bench.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

bench-full: $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints/bench.txt -e '.[bench]'
	$(PY) benchmarks/run_all.py --full $(BENCH_ARGS)

# Not part of `make test`: each strategy's trainer entry sequences, 100 fresh runs each; counts aborts at exit.
stress: $(STAMP)
	$(PY) benchmarks/stress_exit.py --runs $(or $(RUNS),100)

# Not part of `make test`: DiLoCo on torchft, three jobs with one fault each run (killed, frozen, NaN); counts hangs.
stress-torchft: $(STAMP)
	$(PY) benchmarks/torchft_stress.py --runs $(or $(RUNS),21)

clean:
	rm -rf $(VENV) $(LOWEST) lightning_logs wandb out site .pytest_cache
