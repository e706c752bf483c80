"""TrainState: everything a step reads and writes, as one pytree.

``params`` and ``opt_state`` are sharded per the plan; ``step`` counts applied updates; ``rngs``
holds the named PRNG streams (``dropout``, ``data``...); ``loss_scale`` is present with dynamic
loss scaling. ``apply_gradients`` is for hand-written steps (the seed's ``@step_fn`` style); the
engine's own step updates through its learner.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

import jax
import optax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array
    rngs: Dict[str, jax.Array]
    loss_scale: Optional[Dict[str, jax.Array]] = None
    # The replicated params behind `params` while a hand-written step runs (the engine gives the
    # step params cast to varying for differentiation); None otherwise.
    reference_params: Any = None
    # The optax transformation, for apply_gradients in hand-written steps (not part of the pytree).
    tx: Optional[optax.GradientTransformation] = dataclasses.field(
        default=None, metadata=dict(static=True))

    def apply_gradients(self, *, grads: Any) -> "TrainState":
        """One optimizer update with ``grads`` (already reduced by the caller)."""
        params = self.reference_params if self.reference_params is not None else self.params
        updates, opt_state = self.tx.update(grads, self.opt_state, params)
        return dataclasses.replace(self, params=optax.apply_updates(params, updates),
                                   opt_state=opt_state, step=self.step + 1)

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)
