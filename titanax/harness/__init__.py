"""Benchmarks as users run them: lm-evaluation-harness on Titanax's sharded forward and sampler
(``lm.py``; ``python -m titanax.evaluate``)."""
