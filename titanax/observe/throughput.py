"""FLOPs of a compiled step, and model FLOP utilisation (MFU) where the device's peak is known.

The FLOP count comes from XLA's cost analysis of the compiled (per-device) program, so it counts
what really runs, remat included. MFU divides achieved FLOP/s by the device's dense bfloat16 peak;
on devices not in the table (CPUs) it is reported as unknown rather than guessed.
"""

from __future__ import annotations

from typing import Optional

import jax

# Dense bfloat16 peak FLOP/s per device (vendor figures, without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}


def compiled_flops(compiled) -> Optional[float]:
    """FLOPs of one call of a compiled program, per device (None when XLA does not say)."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # pylint: disable=broad-except
        return None
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    if not analysis or "flops" not in analysis:
        return None
    return float(analysis["flops"])


def peak_flops(device: Optional[jax.Device] = None) -> Optional[float]:
    """Peak bf16 FLOP/s of ``device`` (default: the first device), or None if unknown."""
    device = device or jax.devices()[0]
    kind = getattr(device, "device_kind", "") or ""
    for name, peak in PEAK_BF16_FLOPS.items():
        if name.lower() in kind.lower():
            return peak
    return None


def mfu(flops_per_step: Optional[float], step_time_s: float,
        device: Optional[jax.Device] = None) -> Optional[float]:
    """Achieved / peak FLOP/s per device, or None when either is unknown."""
    peak = peak_flops(device)
    if flops_per_step is None or peak is None or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / peak
