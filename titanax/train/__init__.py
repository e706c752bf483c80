"""Training: the engine, its step, the learner, precision and PRNG streams."""
