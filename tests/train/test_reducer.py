"""The gradient reducer (train/reducer.py) against an independent numpy computation.

On a data x model x pipe mesh, params of every kind of layout -- replicated, split over one
axis, over two, over the data axis -- get per-device local gradients; the reduced gradient of
each must be its one-device value (mean over data shards, sum over the devices that hold copies),
and the global norm the norm of the whole, with the metrics averaged and summed as declared.
With shard weights (token counts), the gradients handed in are those of weight x loss, and the
reduced ones the weighted mean: sum over the data shards over the sum of the weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from titanax.runtime.mesh import MeshSpec
from titanax.train.gradients import LossRelation
from titanax.train.reducer import GradientReducer
from tests.numerics import assert_close, parity_floats

pytestmark = pytest.mark.usefixtures("float64_numerics")

AXES = ("data", "model", "pipe")
SPECS = {"replicated": P(), "by_model": P("model"), "by_pipe": P(None, "pipe"),
         "by_both": P("model", "pipe"), "by_data": P("data")}
LOCAL = (4, 4)


def _expected(name, grads, weights=None):
    """grads[d, m, p]: every device's local gradient (numpy); ``weights[d]``: the data shards'
    weights (the grads are then of weight x loss)."""
    spec = SPECS[name]
    split = {a for entry in spec for a in ((entry,) if isinstance(entry, str) else entry or ())}
    over = tuple(i for i, a in enumerate(AXES) if a not in split and a != "data")
    reduced = grads.sum(axis=over, keepdims=True)
    if weights is not None:  # A split param's shard is its own: only scaled by the mean weight.
        reduced = reduced / weights.mean()
    if "data" not in split:
        reduced = reduced.mean(axis=0, keepdims=True)
    # Assemble the global array: the split axes' blocks side by side along their dims.
    blocks = reduced
    rows = []
    for d in range(blocks.shape[0]):
        for m in range(blocks.shape[1]):
            for p in range(blocks.shape[2]):
                rows.append(((d, m, p), blocks[d, m, p]))
    index = {"data": 0, "model": 1, "pipe": 2}
    shape = list(LOCAL)
    for dim, entry in enumerate(spec):
        if entry:
            shape[dim] *= 2
    out = np.zeros(shape, reduced.dtype)
    for (d, m, p), block in rows:
        start = [0, 0]
        for dim, entry in enumerate(spec):
            if entry:
                start[dim] = (d, m, p)[index[entry]] * LOCAL[dim]
        out[start[0]:start[0] + LOCAL[0], start[1]:start[1] + LOCAL[1]] = block
    return out


@pytest.mark.parametrize("weighted", [False, True], ids=["equal", "weighted"])
@pytest.mark.parametrize("sync", [True, False])
def test_reducer_matches_numpy_on_a_three_axis_mesh(sync, weighted):
    mesh = MeshSpec(axes=AXES, shape=(2, 2, 2)).build()
    rng = np.random.default_rng(0)
    local = parity_floats({name: rng.normal(size=(2, 2, 2) + LOCAL).astype(np.float32)
                           for name in SPECS})
    losses = parity_floats(rng.normal(size=(2, 1, 1)).astype(np.float32))  # Copies.
    weights = parity_floats(np.array([0.25, 1.5], np.float32).reshape(2, 1, 1))  # Per shard.
    reducer = GradientReducer.plan(param_specs=SPECS, mesh_shape=dict(zip(AXES, (2, 2, 2))),
                                   data_axis="data",
                                   loss_relation=LossRelation(mean_over=("data",),
                                                              copy_over=("model", "pipe")))

    def run(grads, loss, weight):
        grads = {k: v[0, 0, 0] for k, v in grads.items()}
        loss = jax.lax.pcast(loss[0, 0, 0], ("model", "pipe"), to="varying")
        out = reducer.reduce(grads, mean_metrics={"loss": loss},
                             sum_metrics={"count": 3.0 + 0 * loss}, sync_data=sync,
                             weight=weight[0, 0, 0] if weighted else None)
        metrics = {k: v[None] for k, v in out.metrics.items()} if not sync else out.metrics
        return out.grads, metrics, out.norm_squared

    in_spec = P(*AXES)
    metric_spec = P() if sync else P("data")
    grads, metrics, norm_squared = jax.jit(jax.shard_map(
        run, mesh=mesh, in_specs=({k: in_spec for k in SPECS}, P("data"), P("data")),
        out_specs=(SPECS, {"loss": metric_spec, "count": metric_spec}, P())))(local, losses,
                                                                             weights)
    total = 0.0
    for name in SPECS:
        want = _expected(name, local[name], weights.reshape(-1) if weighted else None)
        assert_close(grads[name], want, what=name)
        total += float(np.sum(want.astype(np.float64) ** 2))
    assert_close(norm_squared, total, what="squared norm")
    if sync and weighted:  # Each shard's mean loss over its own weight.
        want_loss = (losses * weights).sum() / weights.sum()
        assert_close(metrics["loss"], want_loss, what="token-weighted loss")
        assert float(metrics["count"]) == 6.0
    elif sync:
        assert_close(metrics["loss"], losses.mean(), what="loss")
        assert float(metrics["count"]) == 6.0  # Summed over the 2 data shards.
    else:
        assert_close(metrics["loss"], losses.reshape(-1), what="loss per data shard")


def test_partial_sums_are_summed_not_averaged():
    mesh = MeshSpec(axes=("data", "pipe"), shape=(4, 2)).build()
    reducer = GradientReducer.plan(
        param_specs={"w": P()}, mesh_shape={"data": 4, "pipe": 2}, data_axis="data",
        loss_relation=LossRelation(mean_over=("data",), sum_over=("pipe",)))

    def run(part):
        out = reducer.reduce({"w": jnp.zeros(())}, mean_metrics={"loss": part[0, 0]},
                             sum_metrics={})
        return out.metrics["loss"]

    parts = np.arange(8, dtype=np.float32).reshape(4, 2)  # [data, pipe] partial losses
    got = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("data", "pipe"), out_specs=P()))(parts)
    assert_close(got, parts.sum(axis=1).mean(), what="loss")
