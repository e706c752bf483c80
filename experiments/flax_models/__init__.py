"""The Flax models of the Flax experiments, imported when an experiment is built (the launcher
imports every module of ``experiments/`` to list them, and this package's modules only when
named): listing or launching another experiment imports no flax."""
