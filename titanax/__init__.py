"""Titanax: explicit-parallel training for JAX.

Importing ``titanax`` is cheap and does not start jax; the jax-facing parts live in subpackages
(``titanax.modules``, ``titanax.parallel``, ``titanax.train``...) that are imported on use.
"""

__version__ = "0.1.0"
