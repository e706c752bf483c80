#!/bin/bash
# Titanax run llama_tiny_dp_tp: 2 nodes x 8 GPUs, one process per node.
# Submit with `sbatch <this file>`; see docs/clusters.md.
#SBATCH --job-name=llama-tiny-dp-tp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
# SIGTERM 300 s before the time limit: the run saves and stops.
#SBATCH --signal=TERM@300
set -euo pipefail
# Process 0's host runs jax's coordination service.
TITANAX_COORDINATOR_ADDRESS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):1234"
export TITANAX_COORDINATOR_ADDRESS TITANAX_NUM_PROCESSES=2
# Each task's index in the job is its process id.
srun --nodes=2 --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'TITANAX_PROCESS_ID="$SLURM_PROCID" exec "$@"' titanax \
    python -m titanax.launch \
      --config=llama_tiny_dp_tp \
      --trainer_dir=runs/llama_tiny_dp_tp
