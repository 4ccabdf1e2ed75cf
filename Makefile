PY ?= python
.PHONY: help suites install proto proto-check lint typecheck test-fast test test-demo test-extended soak test-all test-newest cluster bench
SUITE ?= quick

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install:  ## install odmoe (and the odmoe-bench suites beside it) for development on a CPU machine
	$(PY) -m pip install -c constraints-cpu.txt torch==2.13.0
	$(PY) -m pip install -c constraints-cpu.txt -e ".[dev]" -e ./benchmarks

proto:  ## regenerate odmoe/rpc/*_pb2*.py from protos/ (never edit those by hand)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/odmoe/rpc/odmoe.proto

proto-check:  ## fail if the generated code drifted from protos/
	$(PY) -m pytest -q tests/test_proto_drift.py

lint:  ## ruff lint + format check, and the pure modules' types (mypy)
	ruff check . && ruff format --check . && $(PY) -m mypy

typecheck:  ## mypy on the pure modules (pyproject's tool.mypy)
	$(PY) -m mypy

test-fast:  ## the fast tier: the pure files' default tests (pure modules, the engine with in-process workers vs transformers; < 2 min on 2 quiet cores)
	$(PY) -m pytest -m fast

test:  ## the default test suite (what CI runs)
	$(PY) -m pytest

test-demo:  ## the README's first command from an empty model cache, its text compared with generate()'s and, on Intel CPUs, the README's (~5 min)
	$(PY) -m pytest -m demo tests/test_demo.py

test-extended:  ## the multi-process tests kept out of the default run for time (~40 min)
	$(PY) -m pytest -m extended

soak:  ## two soaks of 1,000 requests: random node failures (~10 min), and node + network faults (~5 min)
	$(PY) -m pytest -m slow tests/test_soak.py

test-all:  ## everything, slow soak tests included
	$(PY) -m pytest -m ""

test-newest:  ## the tests against the newest versions pyproject's ranges allow, in a new venv (ARGS: pytest args)
	.ci/test-newest $(ARGS)

cluster:  ## a whole local cluster answering one prompt on the demo model (trained on first use)
	odmoe-launch role=local

suites:  ## every benchmark suite and what it measures (from benchmarks/conf/suite/*.yaml)
	$(PY) -m odmoe_bench.config

bench:  ## a benchmark suite: make bench SUITE=<name> (make suites lists them; quick: all, small)
	odmoe-bench suite=$(SUITE)
