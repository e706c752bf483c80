"""Test setup: 8 simulated CPU devices and jax's persistent compilation cache.

Both must be configured before jax starts, so this runs first and sets them in the environment
(which subprocesses started by tests inherit too).
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from titanax.runtime.cpu_devices import simulate_cpu_devices  # noqa: E402

TEST_DEVICE_COUNT = 8
simulate_cpu_devices(TEST_DEVICE_COUNT)

_CACHE_DIR = os.environ.get("TITANAX_TEST_COMPILATION_CACHE",
                            os.path.join(REPO_ROOT, ".cache", "jax_compilation"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Subprocesses started by tests import the checkout, not an installed copy.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)
