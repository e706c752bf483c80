#!/usr/bin/env bash
# The GPU check a session with a lent GPU runs (the device tool), in under 8 minutes on one H100:
# dense vs fused vs blockwise attention at 8k tokens (time, memory, parity), then tokens/s and
# MFU of GPT-2 124M and Llama 3.2 1B. Each part is time-boxed so one slow part cannot eat the rest.
#   bash benchmarks/gpu_check.sh                 (results also under $OUT when it is set)
set -u
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 170 "$PY" benchmarks/attention_kernels.py --seq 8192 --json "$RESULTS/attention_8k.json"
echo "attention_kernels exit $?"
timeout 140 "$PY" benchmarks/gpu_throughput.py --model gpt2_124m --steps 10
echo "gpt2_124m exit $?"
timeout 150 "$PY" benchmarks/gpu_throughput.py --model llama3_1b --steps 10
echo "llama3_1b exit $?"
