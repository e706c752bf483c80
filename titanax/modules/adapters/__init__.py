"""Models written in other libraries, trained as Titanax models.

``FlaxNNX`` (flax_nnx.py) and ``FlaxLinen`` (flax_linen.py) adapt a Flax module built by a
factory in the config tree; flax_module.py has what they share, objectives.py what their
outputs are trained on. ``docs/flax.md`` is the user's guide. Importing this package imports
flax; ``titanax.modules.FlaxNNX`` / ``FlaxLinen`` import it on first use.
"""
