"""Values every rematerialisation policy keeps for the backward pass.

A remat policy (``jax.checkpoint``) decides per primitive whether a forward value is saved or
recomputed in the backward pass. Recomputing a value that came out of a collective repeats the
collective: a mixture of experts' token exchange recomputed under remat sends every token over
the expert axis twice more per layer (6 all-to-alls instead of 4). So the exchanged buffers are
named (``EXPERT_EXCHANGE``) and every policy the layers and stacks use saves them
(``keeping_exchanges``); what they cost is one ``[E, C, D]`` buffer each way per layer.
"""

from __future__ import annotations

from typing import Callable

import jax

# The name of the buffers an MoE layer's all-to-alls return (modules/layers/moe.py).
EXPERT_EXCHANGE = "titanax_expert_exchange"


def keeping_exchanges(policy: Callable) -> Callable:
    """``policy``, saving the named exchanged buffers as well."""
    return jax.checkpoint_policies.save_from_both_policies(
        policy, jax.checkpoint_policies.save_only_these_names(EXPERT_EXCHANGE))
