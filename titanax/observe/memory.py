"""A memory watermark for the progress line: how close the run is to the device's memory.

Accelerators report what their allocator has seen (``device.memory_stats()["peak_bytes_in_use"]``,
the largest of the local devices). The CPU backend reports nothing, so there the figure is the
compiled step's own need from XLA's memory analysis: arguments + outputs + temporaries, less the
buffers donated from inputs to outputs -- per device, as planned rather than observed.
"""

from __future__ import annotations

from typing import Any, Optional

import jax


def device_peak_bytes() -> Optional[int]:
    """The largest peak allocation over this process's devices, or None if not reported."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # pylint: disable=broad-except
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def compiled_step_bytes(compiled: Any) -> Optional[int]:
    """Per-device bytes a compiled program needs while it runs (XLA memory analysis)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # pylint: disable=broad-except
        return None
    if analysis is None:
        return None
    total = sum(int(getattr(analysis, name, 0) or 0) for name in
                ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes"))
    return total - int(getattr(analysis, "alias_size_in_bytes", 0) or 0)


def watermark_bytes(compiled_bytes: Optional[int] = None) -> Optional[int]:
    """The device's observed peak where the backend has one, else ``compiled_bytes`` (the
    compiled step's need, from ``compiled_step_bytes``, read once per compile)."""
    observed = device_peak_bytes()
    return observed if observed is not None else compiled_bytes
