# refppo developer entry points.
#   make demo   set everything up, then run the main job
#   make test   set everything up, then lint, type-check and run the whole test suite
# GPU users: make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# exact dependency versions for reproducible tests; CONSTRAINTS= installs the newest allowed instead
CONSTRAINTS ?= tools/constraints.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.refppo-installed

.PHONY: setup demo test lint typecheck pytest verify bench golden clean

$(STAMP): pyproject.toml Makefile tools/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/refppo demo

verify: $(STAMP)
	$(BIN)/refppo verify

lint: $(STAMP)
	$(BIN)/ruff check refppo tools tests benchmarks
	$(BIN)/ruff format --check refppo tools tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy refppo tools

pytest: $(STAMP)
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

golden: $(STAMP)
	$(BIN)/python tools/make_golden.py

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
