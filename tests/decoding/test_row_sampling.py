"""Per-row sampling (titanax/decoding/row_sampling.py) is ``sampling.next_token`` row by row:
greedy, a temperature, top-p -- the same key gives the same token -- and top-k keeps the k
most likely."""

import jax
import jax.numpy as jnp
import numpy as np

from titanax.decoding import row_sampling
from titanax.modules import sampling


def test_each_row_draws_what_next_token_draws_with_its_settings():
    logits = jax.random.normal(jax.random.PRNGKey(0), (6, 50)) * 3
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    temperature = jnp.asarray([0.0, 1.0, 0.7, 1.3, 1.0, 1.0])
    top_p = jnp.asarray([1.0, 1.0, 0.9, 0.5, 1.0, 1.0])
    got = row_sampling.next_tokens(logits, keys, temperature=temperature, top_p=top_p,
                                   top_k=jnp.zeros(6, jnp.int32))
    for row in range(6):
        want = sampling.next_token(logits[row:row + 1], keys[row],
                                   temperature=float(temperature[row]), top_p=float(top_p[row]))
        assert int(got[row]) == int(want[0]), row


def test_top_k_keeps_the_k_most_likely():
    logits = jnp.tile(jnp.arange(20.0) / 10, (400, 1))  # Token 19 most likely, then 18, ...
    keys = jax.random.split(jax.random.PRNGKey(2), 400)
    ones = jnp.ones(400)
    drawn = np.asarray(row_sampling.next_tokens(logits, keys, temperature=ones, top_p=ones,
                                                top_k=jnp.full(400, 3, jnp.int32)))
    assert set(drawn) == {17, 18, 19}
