"""Metrics leave the step identical on every device: the one rule for eval and hand-written steps.

(The model train step's metrics ride in the gradient reducer's collectives instead -- the same
rule, applied there without collectives of their own: ``reducer.py``.)
"""

from __future__ import annotations

from typing import Collection, Dict, Sequence

import jax

from titanax.parallel import collectives, sharding


def reduce_metrics(metrics: Dict[str, jax.Array], *, batch_axes: Sequence[str],
                   axes: Sequence[str], summed: Collection[str] = ()) -> Dict[str, jax.Array]:
    """Every metric averaged over ``batch_axes`` -- or summed, for the names in ``summed``
    (counts) -- and, on the other ``axes`` it varies over, averaged as the identical copies it
    is there (which leaves its value unchanged and makes it invariant).

    Over a batch axis every shard's value is its own whether jax types it as varying or not (a
    count of ``sum(ones)`` is not), so the batch axes are reduced regardless."""
    copies: Dict[tuple, Dict[str, jax.Array]] = {}
    for name, value in metrics.items():
        over = tuple(a for a in axes if a not in batch_axes and a in collectives.varying_axes(value))
        copies.setdefault(over, {})[name] = value
    out: Dict[str, jax.Array] = {}
    for over, group in copies.items():  # One collective per set of axes, not one per metric.
        out.update(collectives.pmean(group, over) if over else group)
    if batch_axes:
        batch = sharding.axis_entry(batch_axes)
        means = {k: v for k, v in out.items() if k not in summed}
        sums = {k: v for k, v in out.items() if k in summed}
        out = {**(collectives.pmean(means, batch) if means else {}),
               **(collectives.psum(sums, batch) if sums else {})}
    return {name: out[name] for name in metrics}
