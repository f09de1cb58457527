# Two commands do all of their own set-up on a fresh machine:
#   make test        create .venv, install, run the test suite
#   make reproduce   create .venv, install, run the CPU expert-churn reproduction, compare it with the committed
#                    results/churn_repro (within the seed CIs?), then write results/churn_repro
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel; an unpinned torch would pull a CUDA build of several GB.
TORCH  := torch==2.13.0
# Small tensors are far faster on one thread on these machines (see README, "Threads").
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

# Parallel sweep workers; each gets max(1, cores // workers) torch threads.
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: install test reproduce reproduce-all bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

test: install
	$(BIN)/python -m pytest -q

# The CPU expert-churn reproduction (time: experiments/churn_repro.py; under 30 min on 2 cores): the churn_repro sweep,
# its report into outputs/churn_repro, then, per cell, whether each new value lies inside the committed 95% CI over
# seeds (results/churn_repro/tables/churn_vs_lr_depth.csv is read before anything replaces it), and last the new
# report replaces results/churn_repro. Same machine: identical numbers; another machine: within the CIs, not
# identical (CPU kernels round differently). Re-running skips finished runs and resumes interrupted ones.
COMMITTED := results/churn_repro/tables/churn_vs_lr_depth.csv
reproduce: install
	$(BIN)/moe-rl sweep churn_repro --workers $(WORKERS)
	rm -rf outputs/churn_repro
	$(BIN)/moe-rl report sweeps/churn_repro --out outputs/churn_repro
	@if [ -f $(COMMITTED) ]; then \
		$(BIN)/python -m analysis.compare_committed outputs/churn_repro/tables/churn_vs_lr_depth.csv $(COMMITTED); \
	else echo "reproduce: no committed $(COMMITTED) to compare with"; fi
	rm -rf results/churn_repro && cp -r outputs/churn_repro results/churn_repro

# Every committed study: the churn reproduction, the objective comparison (about 33 min on 2 cores) and the stress
# arm (about 10 min), reported as committed (training metrics over the last 5 rollout steps).
reproduce-all: reproduce
	$(BIN)/moe-rl sweep objective_comparison --workers $(WORKERS)
	$(BIN)/moe-rl report sweeps/objective_comparison --out results/objective_comparison --last-k 5
	$(BIN)/moe-rl sweep stress --workers $(WORKERS)
	$(BIN)/moe-rl report sweeps/stress --out results/stress --last-k 5

# Speed and overhead benchmarks (scripts, not tests; a few minutes); they write results/bench/*.md and *.csv.
bench: install
	$(BIN)/python -m benchmarks.bench_model
	$(BIN)/python -m benchmarks.bench_step
	$(BIN)/python -m benchmarks.bench_probes

clean:
	rm -rf $(VENV) .pytest_cache
