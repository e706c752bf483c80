"""Objectives: what a run trains its model toward, each a plug-in behind ``train/objective.py``
(the Engine, the training loop and the gradient computer name none of them).

``preference.py`` (DPO, IPO, hinge, SimPO, ORPO on pairs), ``grpo.py`` (GRPO and its variants on
completions the model samples). ``frozen.py`` holds what objectives with a reference or teacher
model share; ``sampling.py`` what objectives that sample share.
"""
