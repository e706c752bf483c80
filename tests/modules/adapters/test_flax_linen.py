"""FlaxLinen: a Linen CNN with BatchNorm trained by the Engine equals the same CNN trained by
plain Flax + optax on whole batches (same init, same batches, SGD, float32) under DP, ZeRO-1,
ZeRO-2 and FSDP, BatchNorm's running statistics included; a Linen ``nn.scan`` stack is gathered
one layer at a time under FSDP."""

import orbax.checkpoint as ocp
import pytest

from titanax.io.checkpointer import OrbaxCheckpoint
from tests.modules.adapters import flax_runs
from tests.numerics import assert_close, assert_identical
from tests.train import helpers


@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["dp", "zero1", "zero2", "fsdp"])
def test_trains_like_plain_flax(zero):
    engine = flax_runs.engine(flax_runs.linen_model(), zero=zero)
    initial, losses, final = flax_runs.train(engine, flax_runs.image_batches())
    want_initial, want_losses, want_final = flax_runs.plain_linen()
    assert_close(initial, want_initial, what="initial variables (the module's own init)")
    assert_close(losses, want_losses, what="per-step losses")
    assert_close(final["params"], want_final["params"], what="final params")
    assert_close(final["batch_stats"], want_final["batch_stats"],
                 what="BatchNorm's running statistics")


def test_scanned_stack_is_gathered_per_layer_under_fsdp():
    engine = flax_runs.engine(flax_runs.scanned_mlp_model(), zero=3)
    initial, losses, final = flax_runs.train(engine, flax_runs.image_batches())
    want_initial, want_losses, want_final = flax_runs.plain_scanned_mlp()
    assert_close(initial, want_initial, what="initial params")
    assert_close(losses, want_losses, what="per-step losses")
    assert_close(final, want_final, what="final params")
    stacked = engine.model.stacked_paths
    assert stacked == ("params/ScanLayer_0/Dense_0/bias", "params/ScanLayer_0/Dense_0/kernel")
    gathers = flax_runs.in_loop_gathers(engine)
    assert gathers["forward"] == len(stacked) <= gathers["backward"] <= len(stacked) + 2
    program = engine.compiled_train_step().latest.as_text()
    assert flax_runs.hlo_shape(engine.parameter_specs["params"]["ScanLayer_0"]["Dense_0"][
        "kernel"]) not in program  # Never every layer's gathered kernel at once.


def test_params_only_restore_reads_the_flax_paths(tmp_path):
    """A checkpoint of the adapted CNN (params and BatchNorm statistics at their Flax paths)
    read by a run with another optimizer, params only: the same values, step 0; readable by
    plain Orbax."""
    trained = flax_runs.engine(flax_runs.linen_model(), zero=3, checkpoint=_checkpoint(tmp_path))
    trained.fit(data=iter(flax_runs.image_batches()), steps=2)
    trained.close()
    want = flax_runs.numpy_tree(trained.canonical_params())
    other = flax_runs.engine(flax_runs.linen_model(), learner=helpers.adam(),
                             checkpoint=_checkpoint(tmp_path))
    assert other.restore(mode="params") and int(other.state.step) == 0
    assert_identical(flax_runs.numpy_tree(other.canonical_params()), want)
    assert sorted(want) == ["batch_stats", "params"]
    plain = ocp.StandardCheckpointer().restore(tmp_path / "2" / "params")
    assert_identical(plain["batch_stats"], want["batch_stats"])


def _checkpoint(path):
    return OrbaxCheckpoint.default_config().set(path=str(path), async_save=False)
