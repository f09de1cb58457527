# Run from the repository root after `make test-engine` (which creates .venv-vllm).
set -u
mkdir -p ${OUT:-runs/engine_mismatch}
for arm in "native bf16" "vllm bf16" "vllm trainer" "native trainer"; do
set -- $arm
.venv-vllm/bin/python -m moe_rl.cli train --model.backend hf --model.hf-config qwen3_moe \
  --model.d-model 128 --model.n-heads 4 --model.n-kv-heads 2 --model.n-layers 4 --model.n-experts 16 --model.top-k 4 --model.d-expert 64 --model.d-dense 128 \
  --rollout.engine $1 --routing-mode R3 --rollout.sampling.precision $2 --total-steps 3 --rollout.prompts-per-step 8 --rollout.group-size 8 \
  --rollout.sampling.max-new-tokens 24 --probes.enabled rollout --seed 0 --out-dir ${OUT:-runs/engine_mismatch}/cmp_$1_$2 > ${OUT:-runs/engine_mismatch}/cmp_$1_$2.log 2>&1
echo "$arm rc=$?"
done
