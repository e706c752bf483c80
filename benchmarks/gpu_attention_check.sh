#!/usr/bin/env bash
# The attention kernels on a lent GPU (the device tool), in about 6 minutes: causal at 8k in
# bfloat16, rows packing 4 documents, and float32 (where cuDNN's kernel refuses the dtype).
#   bash benchmarks/gpu_attention_check.sh       (results also under $OUT when it is set)
set -u
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
RESULTS=${OUT:-/tmp/gpu_check}
mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --json "$RESULTS/attention_8k.json"
echo "causal bf16 exit $?"
timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --documents 4 \
  --json "$RESULTS/attention_8k_documents.json"
echo "documents bf16 exit $?"
timeout 150 "$PY" benchmarks/attention_kernels.py --seq 8192 --dtype float32 \
  --json "$RESULTS/attention_8k_f32.json"
echo "causal f32 exit $?"
