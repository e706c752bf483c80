"""Pipeline schedules (parallel/pipeline.py) against the same stages run one after another."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax import errors
from titanax.parallel import collectives, pipeline
from titanax.runtime.mesh import MeshSpec
from tests.numerics import assert_close, float64_reference

STAGES, WIDTH = 4, 8


def _stage(params, x, microbatch=None, stage=None):
    del microbatch, stage
    return jnp.tanh(x @ params["w"] + params["b"])


def _params():
    rng = np.random.default_rng(0)
    return {"w": jnp.asarray(rng.normal(size=(STAGES, WIDTH, WIDTH)) * 0.5, jnp.float32),
            "b": jnp.asarray(rng.normal(size=(STAGES, WIDTH)) * 0.1, jnp.float32)}


def _sequential_loss(params, microbatches):
    x = microbatches
    for s in range(STAGES):
        x = _stage({k: v[s] for k, v in params.items()}, x)
    return jnp.sum(x ** 2), x


def _float64_value_and_grad(fn, params, microbatches):
    """The reference: ``fn``'s loss, output and gradients in float64 (no float32 error of
    its own, so a comparison sees only the pipeline's)."""
    with float64_reference():
        wide = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)
        (loss, out), grads = jax.value_and_grad(fn, has_aux=True)(wide(params),
                                                                  wide(microbatches))
        return jax.device_get((loss, out, grads))


def _pipelined(remat: bool):
    mesh = MeshSpec(axes=("data", "pipe"), shape=(2, STAGES)).build()

    def local(params, microbatches):
        stage_params = {k: v[0] for k, v in params.items()}  # This device's stage.
        varying = collectives.cast_varying(stage_params, ("data",))

        def loss_fn(p):
            out = pipeline.gpipe(_stage, p, microbatches, axis="pipe", remat_ticks=remat)
            last = collectives.axis_index("pipe") == STAGES - 1
            return collectives.psum(jnp.where(last, jnp.sum(out ** 2), 0.0), "pipe"), out

        (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(varying)
        grads = collectives.psum(grads, "data")  # Each data shard saw half the microbatches.
        loss = collectives.psum(loss, "data")
        return loss, {k: v[None] for k, v in grads.items()}, out[None]

    spec = {"w": P("pipe"), "b": P("pipe")}
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P(None, "data")),
                                 out_specs=(P(), spec, P("pipe", None, "data"))))


@pytest.mark.parametrize("remat", [False, True])
def test_gpipe_matches_the_stages_run_in_sequence(remat):
    params = _params()
    microbatches = jnp.asarray(np.random.default_rng(1).normal(size=(6, 4, WIDTH)), jnp.float32)
    want_loss, want_out, want_grads = _float64_value_and_grad(_sequential_loss, params,
                                                              microbatches)
    loss, grads, outs = _pipelined(remat)(params, microbatches)
    assert_close(loss, want_loss, what="loss")
    assert_close(outs[-1], want_out, what="last stage's outputs")
    assert_close(dict(grads), want_grads, what="gradients")


def test_gpipe_refuses_fewer_microbatches_than_stages():
    with pytest.raises(errors.PlanError) as info:
        _pipelined(False)(_params(), jnp.zeros((2, 4, WIDTH)))
    assert "2 microbatches for 4 stages" in info.value.message


def _circular(rounds: int, remat: bool):
    """v = rounds slices per device: global params [v * S, ...] viewed as [v, S, ...]."""
    mesh = MeshSpec(axes=("data", "pipe"), shape=(2, STAGES)).build()
    seen = []

    def local(params, microbatches):
        stage_params = {k: v[:, 0] for k, v in params.items()}  # [v, ...]: this device's slices.
        varying = collectives.cast_varying(stage_params, ("data",))

        def stage(p, x, microbatch, index):
            seen.append(index)
            return _stage(p, x)

        def loss_fn(p):
            out = pipeline.circular(stage, p, microbatches, axis="pipe", virtual_stages=rounds,
                                    remat_ticks=remat)
            last = collectives.axis_index("pipe") == STAGES - 1
            return collectives.psum(jnp.where(last, jnp.sum(out ** 2), 0.0), "pipe"), out

        (loss, out), grads = jax.value_and_grad(loss_fn, has_aux=True)(varying)
        grads = collectives.psum(grads, "data")
        loss = collectives.psum(loss, "data")
        return loss, {k: v[:, None] for k, v in grads.items()}, out[None]

    spec = {"w": P(None, "pipe"), "b": P(None, "pipe")}
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P(None, "data")),
                                 out_specs=(P(), spec, P("pipe", None, "data"))))


@pytest.mark.parametrize("rounds,count,remat", [(2, 4, False), (2, 6, True), (3, 5, False)])
def test_circular_matches_the_stages_run_in_sequence(rounds, count, remat):
    """v S stages in the model's order; M need not be a multiple of S (only M >= S)."""
    rng = np.random.default_rng(2)
    total = rounds * STAGES
    params = {"w": jnp.asarray(rng.normal(size=(total, WIDTH, WIDTH)) * 0.5, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(total, WIDTH)) * 0.1, jnp.float32)}
    microbatches = jnp.asarray(rng.normal(size=(count, 4, WIDTH)), jnp.float32)

    def sequential(p, x):
        for c in range(total):
            x = _stage({k: v[c] for k, v in p.items()}, x)
        return jnp.sum(x ** 2), x

    want_loss, want_out, want_grads = _float64_value_and_grad(sequential, params, microbatches)
    view = {k: v.reshape((rounds, STAGES) + v.shape[1:]) for k, v in params.items()}
    loss, grads, outs = _circular(rounds, remat)(view, microbatches)
    assert_close(loss, want_loss, what="loss")
    assert_close(outs[-1], want_out, what="last stage's outputs")
    assert_close({k: np.asarray(v).reshape(params[k].shape) for k, v in grads.items()},
                 want_grads, what="gradients")


def test_bubble_fraction():
    assert pipeline.bubble_fraction(num_stages=4, num_microbatches=8) == 3 / 11
    assert pipeline.bubble_fraction(num_stages=4, num_microbatches=8, virtual_stages=2) == 3 / 19


@pytest.mark.parametrize("rounds", [1, 2])
def test_stage_summaries_are_partial_sums_of_the_mean_over_stages_and_microbatches(rounds):
    mesh = MeshSpec(axes=("pipe",), shape=(STAGES,), devices=list(range(STAGES))).build()
    rng = np.random.default_rng(3)
    total = rounds * STAGES
    params = {"w": jnp.asarray(rng.normal(size=(total, WIDTH, WIDTH)) * 0.5, jnp.float32),
              "b": jnp.asarray(rng.normal(size=(total, WIDTH)) * 0.1, jnp.float32)}
    microbatches = jnp.asarray(rng.normal(size=(6, 4, WIDTH)), jnp.float32)

    def stage(p, x, microbatch, index):
        y = _stage(p, x)
        return y, {"mean_out": jnp.mean(y), "stage": index.astype(jnp.float32)}

    def local(params, microbatches):
        slices = {k: v[:, 0] for k, v in params.items()}
        _, summaries = pipeline.circular(stage, slices if rounds > 1 else
                                         {k: v[0] for k, v in slices.items()}, microbatches,
                                         axis="pipe", virtual_stages=rounds, with_summaries=True)
        return collectives.psum(summaries, "pipe")

    view = {k: v.reshape((rounds, STAGES) + v.shape[1:]) for k, v in params.items()}
    spec = {"w": P(None, "pipe"), "b": P(None, "pipe")}
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec, P()), out_specs=P()))(
        view, microbatches)
    means = []
    x = microbatches
    for c in range(total):  # Every stage on every microbatch, in order.
        x = jax.vmap(lambda m, c=c: _stage({k: v[c] for k, v in params.items()}, m))(x)
        means.append(jnp.mean(x, axis=(1, 2)))
    assert_close(got["mean_out"], jnp.mean(jnp.stack(means)), what="mean of the stage outputs")
    assert float(got["stage"]) == pytest.approx((total - 1) / 2)  # Mean stage index.
