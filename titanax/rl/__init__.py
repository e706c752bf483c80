"""Reinforcement learning from verifiable rewards, the parts GRPO (``objectives/grpo.py``) is
built from: rollouts with Titanax's own sampler on the training mesh (``rollouts.py``), rewards
(``rewards.py``), group-normalised advantages (``advantages.py``), the clipped policy loss
(``policy_loss.py``) and the rows a step trains on (``rows.py``)."""
