"""FlaxLinen: a Linen CNN with BatchNorm trained by the Engine equals the same CNN trained by
plain Flax + optax on whole batches (same init, same batches, SGD, float32) under DP, ZeRO-1,
ZeRO-2 and FSDP, BatchNorm's running statistics included; a Linen ``nn.scan`` stack is gathered
one layer at a time under FSDP."""

import pytest

from tests.modules.adapters import flax_runs
from tests.numerics import assert_close


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
    assert flax_runs.in_loop_gathers(engine) == 2 * len(stacked)
