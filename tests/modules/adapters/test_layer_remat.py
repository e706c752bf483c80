"""layer_remat: every outermost scan of a traced program -- however it was made -- runs with its
body rematerialised, and computes what it did."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import scan as scan_by_name

from titanax.modules.adapters.layer_remat import with_scans_rematerialised
from tests.numerics import assert_close


def _layers(w, x):
    """Three ways to loop over stacked layers: lax.scan by name, inside a jit, and lax.map."""
    def layer(h, w_i):
        return jnp.tanh(h @ w_i), None

    h, _ = scan_by_name(layer, x, w)
    h = jax.jit(lambda h, w: jax.lax.scan(layer, h, w)[0])(h, w)
    return jnp.sum(jax.lax.map(lambda w_i: jnp.sum(h @ w_i), w))


def _scan_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for key in ("jaxpr", "call_jaxpr"):
            sub = getattr(eqn.params.get(key), "jaxpr", None)
            if sub is not None and eqn.primitive.name != "scan":
                yield from _scan_bodies(sub)


def test_every_outermost_scan_is_rematerialised_and_computes_the_same():
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 4, 4)) / 2
    x = jnp.ones((2, 4))
    remat = with_scans_rematerialised(_layers, jax.checkpoint_policies.nothing_saveable)
    bodies = list(_scan_bodies(jax.make_jaxpr(remat)(w, x).jaxpr))
    assert len(bodies) == 3
    assert all(any(e.primitive.name.startswith(("checkpoint", "remat")) for e in body.eqns)
               for body in bodies)
    plain = list(_scan_bodies(jax.make_jaxpr(_layers)(w, x).jaxpr))
    assert not any(e.primitive.name.startswith(("checkpoint", "remat")) for b in plain for e in b.eqns)
    assert_close(np.asarray(remat(w, x)), np.asarray(_layers(w, x)), what="value")
    assert_close(jax.grad(remat)(w, x), jax.grad(_layers)(w, x), what="gradient")
