"""The environment tests hand to the processes they start (launchers, workers, examples).

They inherit the test session's (conftest.py): the compilation cache and ``PYTHONPATH`` -- but
not its simulated device count, which the child sets itself (``--cpu_devices``, or a worker's own
``simulate_cpu_devices``), nor, by default, the quick XLA backend and the older fusion code
generation: children that run whole trainings gain from LLVM's optimisations (measured, gpt_tiny_pp 20 steps with the cache warm:
18.1 s quick backend, 10.7 s optimised; its steps ~0.5 s vs ~0.1 s). Children that compile and
run a few steps ask for the quick backend (``quick_backend=True``).
"""

from __future__ import annotations

import os
import re
from typing import Dict

# XLA flags of every test process (see conftest.py for why).
QUICK_BACKEND = "--xla_backend_optimization_level=0"
# XLA:CPU's older fusion code generation: it compiles in about half the time (measured, cold
# cache: the sharded-state and context-parallel parity files 259 s -> 135 s, the pipeline and
# expert-parallel ones 457 s -> 198 s) and computes float64 exactly like the newer one -- except
# in the circular pipeline schedule's program, whose loss it is off by 2e-11 of its value (params
# 1e-7 after one SGD step; the newer emitters match one device to 1e-15). Tests of that program
# ask for the newer emitters (the ``fusion_emitters`` fixture, conftest.py). Children that run
# whole trainings drop it: the newer code runs faster (the 20-step MoE and context-parallel
# experiment tests, cold: 74 s with the newer, 83 s with the older).
OLDER_CODEGEN = "--xla_cpu_use_fusion_emitters=false"
# LLVM code generation in one piece instead of several compiled on parallel threads: on the
# suite's two busy cores the split buys no wall time and costs CPU (measured, cold cache, seven
# test files each run both ways: 1.6-15% less CPU in one piece). Every test process and child
# keeps it: it changes how the machine code is produced, not what it computes.
SERIAL_CODEGEN = "--xla_cpu_parallel_codegen_split_count=1"
# The flags of the test process itself.
TEST_PROCESS_FLAGS = f"{QUICK_BACKEND} {OLDER_CODEGEN} {SERIAL_CODEGEN}"


def child_environment(*, keep_device_count: bool = False, quick_backend: bool = False,
                      **changes: str) -> Dict[str, str]:
    """``os.environ`` without the quick-backend flag (unless ``quick_backend``, which brings
    ``OLDER_CODEGEN`` too: a child that compiles and runs a few steps, where compiling dominates
    -- measured, gpt_tiny_dp_tp for 6 steps: 13.0 s of CPU optimised, 9.7 s quick) and without
    the device-count flag (unless ``keep_device_count``: a launch without ``--cpu_devices`` gets
    the session's 8), with ``changes`` applied."""
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if not quick_backend:
        flags = flags.replace(QUICK_BACKEND, "").replace(OLDER_CODEGEN, "")
    if not keep_device_count:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    if quick_backend and OLDER_CODEGEN not in flags:
        flags = f"{flags} {OLDER_CODEGEN}"
    flags = " ".join(flags.split())
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env.update(changes)
    return env
