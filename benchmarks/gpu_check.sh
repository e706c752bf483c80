#!/usr/bin/env bash
# The GPU checks a session with a lent GPU runs (the device tool), each time-boxed so one slow
# part cannot eat the rest (results also under $OUT when it is set):
#   bash benchmarks/gpu_check.sh            dense vs fused vs blockwise attention at 8k tokens
#                                           (time, memory, parity), then tokens/s and MFU of
#                                           GPT-2 124M and Llama 3.2 1B (under 8 min on an H100)
#   bash benchmarks/gpu_check.sh attention  the attention kernels only, at 8k: causal bf16, rows
#                                           packing 4 documents, float32 (about 6 min)
#   bash benchmarks/gpu_check.sh rollouts   the static sampler vs the decode engine at
#                                           qwen3_0_6b_grpo's rollout shape (Qwen3 0.6B, random
#                                           bf16 weights; 16 prompts x 8 samples, 256 + <= 512
#                                           tokens; 600 stop ids: a random model's lengths
#                                           spread to ~250 -- an estimate, not yet run)
#   bash benchmarks/gpu_check.sh fp8        bf16 vs FP8 projections: a 4096 x 14336 MLP block,
#                                           GPT-2 124M and Llama 3.2 1B; then GPT-2 124M by
#                                           Muon against the AdamW run (under 8 min; prepared
#                                           on CPU, not yet run on a GPU)
set -u
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
if [ "${1:-}" = "rollouts" ]; then
  timeout 400 "$PY" benchmarks/rollout_speed.py --parts grpo --shape qwen3_0_6b --prompts 16 \
    --samples 8 --prompt_length 256 --max_new_tokens 512 --stop_ids 600 --rounds 2 \
    | tee "$RESULTS/rollouts_qwen3_0_6b.txt"
  echo "rollouts exit ${PIPESTATUS[0]}"
  exit 0
fi
if [ "${1:-}" = "fp8" ]; then
  timeout 60 "$PY" benchmarks/fp8_mlp.py | tee "$RESULTS/fp8_mlp.txt"
  echo "fp8 mlp exit ${PIPESTATUS[0]}"
  for MODEL in gpt2_124m llama3_1b; do
    for FLAG in "" --fp8; do
      timeout 100 "$PY" benchmarks/gpu_throughput.py --model $MODEL --steps 5 $FLAG \
        | tee "$RESULTS/${MODEL}${FLAG/--/_}.txt"
      echo "$MODEL $FLAG exit ${PIPESTATUS[0]}"
    done
  done
  timeout 90 "$PY" benchmarks/gpu_throughput.py --model gpt2_124m --steps 5 --optimizer muon \
    | tee "$RESULTS/gpt2_124m_muon.txt"
  echo "gpt2_124m muon exit ${PIPESTATUS[0]}"
  exit 0
fi
if [ "${1:-}" = "attention" ]; then
  timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --json "$RESULTS/attention_8k.json"
  echo "causal bf16 exit $?"
  timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --documents 4 \
    --json "$RESULTS/attention_8k_documents.json"
  echo "documents bf16 exit $?"
  timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --dtype float32 \
    --json "$RESULTS/attention_8k_f32.json"
  echo "causal f32 exit $?"
  exit 0
fi
timeout 170 "$PY" benchmarks/attention_kernels.py --seq 8192 --json "$RESULTS/attention_8k.json"
echo "attention_kernels exit $?"
timeout 140 "$PY" benchmarks/gpu_throughput.py --model gpt2_124m --steps 10
echo "gpt2_124m exit $?"
timeout 150 "$PY" benchmarks/gpu_throughput.py --model llama3_1b --steps 10
echo "llama3_1b exit $?"
