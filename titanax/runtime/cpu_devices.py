"""Simulating several CPU devices, so parallel programs run on a laptop or a CI machine.

XLA reads ``--xla_force_host_platform_device_count`` once, when jax starts its CPU backend, so the
count must be set before that. This module does not import jax.

XLA:CPU's concurrency-optimised scheduler is switched off with it (unless XLA_FLAGS says
otherwise): it may start two independent collectives of one program in different orders on
different simulated devices, which then wait for each other in XLA's rendezvous until the process
is aborted (seen: a float64 GPipe step with context parallelism, "Expected 4 threads to join the
rendezvous, but only 3 of them arrived", after 40 s). Simulated devices share the host's threads,
so that scheduler has nothing to gain there.
"""

from __future__ import annotations

import os
import re
import sys

from titanax import errors

_FLAG = "--xla_force_host_platform_device_count"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def simulate_cpu_devices(count: int) -> None:
    """Makes the CPU backend expose ``count`` devices. Must run before jax starts its backend."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise errors.LaunchFlagError(f"must be a positive int, got {count!r}", path="--cpu_devices",
                                     suggestion="e.g. --cpu_devices=8")
    if _backend_started():
        import jax  # pylint: disable=import-outside-toplevel
        if jax.device_count() == count and jax.default_backend() == "cpu":
            return
        raise errors.LaunchFlagError(
            f"jax already started with {jax.device_count()} {jax.default_backend()} device(s); "
            f"cannot switch to {count} simulated CPU devices", path="--cpu_devices",
            suggestion="set the device count before anything initialises jax")
    flags = re.sub(rf"{_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    if _SCHEDULER_FLAG not in flags:
        flags = f"{flags} {_SCHEDULER_FLAG}=false".strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_FLAG}={count}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:
        import jax  # pylint: disable=import-outside-toplevel
        jax.config.update("jax_num_cpu_devices", count)
        jax.config.update("jax_platforms", "cpu")


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
        return bool(getattr(xla_bridge, "_backends", {}))
    except ImportError:  # pragma: no cover - private API moved; assume started to be safe.
        return True
