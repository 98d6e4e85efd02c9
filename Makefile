# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates .venv/ on first use (from the exact pins in requirements-dev.txt) and
# reuses it afterwards.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint bench clean

$(STAMP): requirements-dev.txt requirements-nodeps.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

DEMO_ARGS ?=

demo: $(STAMP)
	$(PY) -m perdure demo $(DEMO_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# -n $(TEST_WORKERS): the suite on that many pytest-xdist worker processes, one test file at
# a time each (pyproject's --dist loadfile); `make test TEST_WORKERS=0` runs it serially in
# one process (docs/testing.md). -X faulthandler: a crash after pytest's own handler is off
# still prints every thread's stack (tests/conftest.py skips the interpreter's teardown
# unless PERDURE_TEST_TEARDOWN=1).
TEST_WORKERS ?= 2

test: lint
	$(PY) -X faulthandler -m pytest -q -n $(TEST_WORKERS)

# The unit tier, for the edit loop: no test that starts a process (tests/conftest.py).
test-fast: $(STAMP)
	PERDURE_TEST_TIER=unit $(PY) -X faulthandler -m pytest -q -n $(TEST_WORKERS) -m "not integration and not slow"

BENCH_STAMP := $(VENV)/.bench-installed

# --no-deps: torchft declares torch, and any resolution of it would fetch a CUDA build.
$(BENCH_STAMP): $(STAMP) requirements-bench.txt
	$(PY) -m pip install -q --no-deps -r requirements-bench.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs
