"""Reinforcement learning from verifiable rewards: GRPO and its 2025 variants (``grpo.py``),
rollouts with Titanax's own sampler on the training mesh (``rollouts.py``), rewards
(``rewards.py``), group-normalised advantages (``advantages.py``) and the clipped policy loss
(``policy_loss.py``)."""
