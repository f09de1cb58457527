# Two commands do all of their own set-up on a fresh machine:
#   make test        create .venv, install, run the test suite
#   make reproduce   create .venv, install, run the CPU expert-churn reproduction (writes results/)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel; an unpinned torch would pull a CUDA build of several GB.
TORCH  := torch==2.13.0
# Small tensors are far faster on one thread on these machines (see README, "Threads").
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

.PHONY: install test reproduce bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

test: install
	$(BIN)/python -m pytest -q

reproduce: install
	$(BIN)/python -m benchmarks.bench_model

bench: install
	$(BIN)/python -m benchmarks.bench_model

clean:
	rm -rf $(VENV) .pytest_cache
