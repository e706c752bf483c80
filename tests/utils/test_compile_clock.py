"""The compile clock (titanax/utils/compile_clock.py): a program made inside it counts as
compiling, the same program run again does not, and only what runs inside a clock counts."""

import jax
import jax.numpy as jnp

from titanax.utils.compile_clock import CompileClock


def test_compiling_counts_inside_the_clock_and_running_a_made_program_does_not():
    fn = jax.jit(lambda x: jnp.cumsum(jnp.sin(x) * 3.0) @ x)
    with CompileClock() as first:
        fn(jnp.arange(64.0)).block_until_ready()
    assert 0 < first.compile_seconds <= first.seconds, (first.compile_seconds, first.seconds)
    assert abs(first.run_seconds - (first.seconds - first.compile_seconds)) < 1e-12
    counted = first.compile_seconds
    jax.jit(lambda x: x * 5.0 - 1.0)(jnp.ones(7)).block_until_ready()  # (Outside any clock.)
    assert first.compile_seconds == counted
    with CompileClock() as second:
        fn(jnp.arange(64.0)).block_until_ready()
    assert second.compile_seconds == 0 and second.seconds > 0
