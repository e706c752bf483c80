"""Aux-loss-free balancing on moe_tiny_ep: the experts' load imbalance with the bias off and on.

Runs ``python -m titanax.launch --config=moe_tiny_ep`` for ``--steps`` steps (200) once per
``--config.model.moe.router.balance_rate`` in ``--rates`` (0 = off), everything else the
experiment's (its small load-balancing loss included), and reads ``metrics.csv``. The imbalance is
``expert_load/max``: the most loaded expert's assignments over the mean, over the whole batch
(every device's tokens), the mean over the 4 layers; reported at the last step and as the mean
over the last 20 steps, with the loss.

    python benchmarks/moe_balance.py [--steps=200] [--rates=0,0.001,0.01]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOAD = "summaries/decoder/layer/mlp/expert_load/max"


def run(rate: float, steps: int, directory: str):
    """``(rows by step)`` of one moe_tiny_ep run with the given balance rate."""
    result = subprocess.run(
        [sys.executable, "-m", "titanax.launch", "--config=moe_tiny_ep", "--cpu_devices=8",
         f"--trainer_dir={directory}", f"--config.max_steps={steps}", "--config.log_every=10",
         "--config.evalers={}", "--config.checkpoint=None",
         f"--config.model.moe.router.balance_rate={rate}"],
        cwd=REPO, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    with open(os.path.join(directory, "metrics.csv"), encoding="utf-8") as f:
        return {int(r["step"]): r for r in csv.DictReader(f) if r.get("loss")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rates", default="0,0.001,0.01")
    args = parser.parse_args()
    print(f"moe_tiny_ep, {args.steps} steps; imbalance = max expert load / mean over the "
          "batch, mean over the layers")
    print(f"{'balance_rate':>12}  {'imbalance (last)':>16}  {'imbalance (last 20)':>19}  "
          f"{'loss (last)':>11}")
    with tempfile.TemporaryDirectory() as root:
        for rate in (float(r) for r in args.rates.split(",")):
            rows = run(rate, args.steps, os.path.join(root, f"rate_{rate}"))
            last = max(rows)
            tail = [float(rows[s][LOAD]) for s in rows if s > last - 20]
            print(f"{rate:>12g}  {float(rows[last][LOAD]):>16.3f}  "
                  f"{sum(tail) / len(tail):>19.3f}  {float(rows[last]['loss']):>11.4f}")


if __name__ == "__main__":
    main()
