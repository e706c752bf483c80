"""Checkpoints: round trips across meshes, bit-identical resume, damage, mismatches, interop."""

import logging
import os
import shutil
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest

from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.sources import MNIST, TextWindows
from titanax.io.checkpointer import OrbaxCheckpoint
from tests.numerics import assert_close
from tests.train import helpers

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _text_input() -> Input.Config:
    return Input.default_config().set(source=TextWindows.default_config().set(seq_len=16),
                                      global_batch_size=8, seed=5)


def _gpt(path, data, model_axis, **changes):
    return helpers.gpt_engine(
        data=data, model_axis=model_axis, train_input=_text_input(),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(path), save_every_n_steps=5,
                                                        keep_last_n=None), **changes)


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def saved_on_4x2(tmp_path_factory):
    """A run trained 5 steps on data=4 x model=2, saved, then continued to 10 steps."""
    path = tmp_path_factory.mktemp("ckpt_4x2")
    engine = _gpt(path, 4, 2)
    engine.fit(steps=5)
    at_5 = (_host(engine.state.params), _host(engine.state.opt_state))
    engine.fit(steps=10)
    losses = [h["loss"] for h in engine.history]
    return path, at_5, losses


@pytest.mark.parametrize("data,model_axis", [(2, 4), (8, 1), (1, 1)])
def test_restore_on_another_mesh_and_continue(saved_on_4x2, tmp_path, data, model_axis):
    source, (params_5, opt_5), losses = saved_on_4x2
    path = tmp_path / "copy"
    shutil.copytree(source, path)
    shutil.rmtree(path / "10")  # Resume from step 5, as if the run had stopped there.
    engine = _gpt(path, data, model_axis)
    assert engine.restore() and engine.restored_from.endswith("/5")
    assert int(engine.state.step) == 5
    for got, want in zip(jax.tree_util.tree_leaves(_host(engine.state.params)),
                         jax.tree_util.tree_leaves(params_5)):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(jax.tree_util.tree_leaves(_host(engine.state.opt_state)),
                         jax.tree_util.tree_leaves(opt_5)):
        np.testing.assert_array_equal(got, want)
    spec = engine.state.params["decoder"]["layer"]["mlp"]["up"]["weight"].sharding.spec
    assert spec == engine.param_specs["decoder"]["layer"]["mlp"]["up"]["weight"]
    engine.fit(steps=10)  # The data position was restored too: same batches as the original.
    assert_close([h["loss"] for h in engine.history], losses[5:], what="losses after the restore")


class BatchChecksums:
    """A hook recording a checksum of every batch the run consumed."""

    def __init__(self):
        self.sums = {}

    def on_batch(self, step, batch):
        self.sums[step] = zlib.crc32(b"".join(np.ascontiguousarray(batch[k]).tobytes()
                                              for k in sorted(batch)))


def _mnist(path, hooks=()):
    return helpers.mnist_engine(
        data=8, train_input=Input.default_config().set(source=MNIST.default_config(),
                                                       global_batch_size=64, seed=3),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(path), save_every_n_steps=10),
        hooks=hooks)


def test_resume_is_bit_identical_and_reads_the_same_batches(tmp_path):
    straight_sums = BatchChecksums()
    straight = _mnist(tmp_path / "straight", [straight_sums])
    straight.fit(steps=20)
    first_sums, second_sums = BatchChecksums(), BatchChecksums()
    _mnist(tmp_path / "resumed", [first_sums]).fit(steps=10)
    resumed = _mnist(tmp_path / "resumed", [second_sums])  # A new engine: a restart.
    resumed.fit(steps=20)
    assert resumed.restored_from.endswith("/10")
    assert sorted(straight_sums.sums) == list(range(20))
    assert {**first_sums.sums, **second_sums.sums} == straight_sums.sums
    assert sorted(second_sums.sums) == list(range(10, 20))
    for got, want in zip(jax.tree_util.tree_leaves(_host(resumed.state.params)),
                         jax.tree_util.tree_leaves(_host(straight.state.params))):
        np.testing.assert_array_equal(got, want)


def test_damaged_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    engine = _mnist(tmp_path)
    engine.fit(steps=20)
    engine.close()
    newest = tmp_path / "20" / "params"
    for root, _, files in os.walk(newest):
        for name in files:
            if name != "_METADATA":
                with open(os.path.join(root, name), "wb") as f:
                    f.write(b"garbage")
    restarted = _mnist(tmp_path)
    with caplog.at_level(logging.WARNING, logger="titanax"):
        assert restarted.restore()
    assert restarted.restored_from.endswith("/10")
    assert any("skipping damaged checkpoint" in r.message and str(tmp_path / "20") in r.message
               for r in caplog.records)
    restarted.close()
    again = _mnist(tmp_path)
    with pytest.raises(errors.CheckpointError) as info:
        again.restore(step=20)
    again.close()
    assert info.value.path.endswith("/20")


def test_mismatch_shows_a_path_shape_dtype_diff_and_params_only_mode(tmp_path):
    _gpt(tmp_path, 8, 1).fit(steps=5)
    other = helpers.gpt_engine(data=8, checkpoint=OrbaxCheckpoint.default_config().set(
        path=str(tmp_path)), learner=helpers.sgd(0.1))
    with pytest.raises(errors.CheckpointError) as info:
        other.restore()  # SGD has no Adam moments: the optimizer state differs.
    assert "opt_state" in info.value.message and "not in this run" in info.value.message
    assert other.restore(mode="params") and int(other.state.step) == 0
    cfg = helpers.gpt_engine(data=8, checkpoint=OrbaxCheckpoint.default_config().set(
        path=str(tmp_path))).config.clone()
    cfg.model.model_dim = 64
    with pytest.raises(errors.CheckpointError) as info:
        cfg.instantiate().restore(mode="params")
    assert "token_emb/weight: checkpoint (256, 32) float32 != this run (256, 64) float32" \
        in info.value.message


def test_retention_and_metadata(tmp_path):
    engine = helpers.mnist_engine(data=8, checkpoint=OrbaxCheckpoint.default_config().set(
        path=str(tmp_path), save_every_n_steps=2, keep_last_n=2, keep_every_n_steps=4))
    engine.fit(data=iter(helpers.mnist_batches()), steps=10)
    assert engine.checkpointer().all_steps() == [4, 8, 10]
    metadata = engine.checkpointer().read_metadata(10)
    assert metadata["mesh_axes"] == ["data"] and metadata["mesh_shape"] == [8]
    assert metadata["params"]["dense0/weight"] == {"spec": [None, None], "shape": [784, 64],
                                                   "dtype": "float32"}
    assert len(metadata["optimizer_config_hash"]) == 16
    assert set(metadata["versions"]) == {"titanax", "jax", "orbax"}
    assert "model.hidden_dims: (64,)" in metadata["config"]
    assert not any("tmp" in name for name in os.listdir(tmp_path))


def test_close_waits_for_orbaxs_cleanup_of_unfinished_step_directories(tmp_path):
    """Orbax's manager removes the temporary directories of unfinished saves in a thread it
    starts when made; ``close()`` returns only after that work is done, so no Orbax thread is
    left to race the interpreter's shutdown (a refused fresh start printed its traceback)."""
    directory = tmp_path / "checkpoints"
    for step in range(500):  # Enough that the cleanup cannot be done the moment close() is.
        (directory / f"{step}.orbax-checkpoint-tmp-{step}").mkdir(parents=True)
    checkpointer = OrbaxCheckpoint(trainer_dir=str(tmp_path))
    assert checkpointer.all_steps() == []
    # The private Orbax method close() relies on (await_orbax_cleanup) still exists.
    assert callable(getattr(checkpointer.manager, "_maybe_await_cleanup_tmp_directory", None))
    checkpointer.close()
    assert os.listdir(directory) == []


def test_plain_orbax_reads_titanax_params(tmp_path):
    engine = _mnist(tmp_path)
    engine.fit(steps=10)
    want = _host(engine.state.params)
    out = tmp_path / "plain.npz"
    code = f"""
import sys, numpy as np, jax, orbax.checkpoint as ocp
manager = ocp.CheckpointManager({str(tmp_path)!r},
                                item_handlers={{"params": ocp.StandardCheckpointHandler()}})
meta = manager.item_metadata(10)["params"]
device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
target = jax.tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                                meta)
params = manager.restore(10, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
flat = {{"/".join(str(k.key) for k in p): np.asarray(v) for p, v in
        jax.tree_util.tree_flatten_with_path(params["params"])[0]}}
np.savez({str(out)!r}, **flat)
assert not any(m.startswith("titanax") for m in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    got = np.load(out)
    for path, value in {"dense0/weight": want["dense0"]["weight"],
                        "dense1/bias": want["dense1"]["bias"]}.items():
        np.testing.assert_array_equal(got[path], value)


def test_padded_last_batch_is_masked():
    from titanax.modules import functional  # pylint: disable=import-outside-toplevel
    cfg = Input.default_config().set(source=MNIST.default_config().set(split="test"),
                                     global_batch_size=300, num_epochs=1, shuffle=False,
                                     last_batch="pad")
    batches = list(cfg.instantiate())
    assert [b["weights"].sum() for b in batches] == [300, 300, 300, 100]
    assert all(b["image"].shape == (300, 28, 28) for b in batches)
    engine = helpers.mnist_engine(data=1)
    engine.init_state()
    last = batches[-1]
    (loss, aux), _ = functional(engine.model, None, engine.state.params, (last,),
                                is_training=False)
    real = {k: v[:100] for k, v in last.items() if k != "weights"}
    (want, want_aux), _ = functional(engine.model, None, engine.state.params, (real,),
                                     is_training=False)
    assert float(aux["num_examples"]) == 100.0
    assert_close(loss, want, what="loss of the padded batch")
    assert float(aux["num_correct"]) == float(want_aux["num_correct"])


def test_a_remote_checkpoint_path_is_kept_as_a_url():
    """gs://, s3://... go to Orbax as given (through etils.epath), never made a local path."""
    assert OrbaxCheckpoint(path="gs://bucket/runs/a").directory == "gs://bucket/runs/a"
    assert OrbaxCheckpoint(path="rel/dir").directory == os.path.abspath("rel/dir")


def test_a_checkpoint_under_the_former_gpt_param_names_restores(tmp_path):
    """GPT checkpoints written before GPT-2 became a configuration of the decoder family hold
    ``decoder/layer/ln1``, ``attn/out``, ``mlp/wi`` ...: written here as such (the state's
    params and Adam moments renamed back, through the checkpointer the old code used), a
    resume reads them under today's names, values and step intact."""
    import dataclasses  # pylint: disable=import-outside-toplevel
    from titanax.io import path_renames  # pylint: disable=import-outside-toplevel
    from titanax.modules.models.decoder import GPT_CHECKPOINT_RENAMES  # pylint: disable=import-outside-toplevel
    from titanax.train import state_sharding  # pylint: disable=import-outside-toplevel
    path = tmp_path / "ckpt"
    engine = _gpt(path, 8, 1)
    engine.fit(steps=2)
    older = path_renames.reversed_renames(GPT_CHECKPOINT_RENAMES)
    state = engine.states.canonical_state(engine.state)
    old = dataclasses.replace(state, params=path_renames.renamed(state.params, older),
                              opt_state=path_renames.renamed(state.opt_state, older))
    assert "ln1" in old.params["decoder"]["layer"] and "up" not in old.params["decoder"]["layer"]["mlp"]
    ckpt = OrbaxCheckpoint.default_config().set(path=str(tmp_path / "old")).instantiate()
    metadata = {"config": engine.config.debug_string(),
                "optimizer_state_layout": dict(state_sharding.CHECKPOINT_LAYOUT)}
    assert ckpt.save(old, 2, metadata=metadata)
    ckpt.wait_until_finished()
    ckpt.close()
    resumed = _gpt(tmp_path / "old", 8, 1)
    assert resumed.restore() and int(resumed.state.step) == 2
    assert_close(_host(resumed.state.params), _host(engine.state.params), bound=0.0,
                 what="params read under today's names")
    assert_close(_host(resumed.state.opt_state), _host(engine.state.opt_state), bound=0.0,
                 what="Adam moments read under today's names")


def test_one_process_writes_whole_arrays_and_says_nothing_of_it(capfd, caplog):
    """In one process Orbax's array handler is switched to writing each array from one replica
    (checkpointer.py): done once, without Orbax's override warning on the user's console."""
    from orbax.checkpoint import type_handlers  # pylint: disable=import-outside-toplevel
    from titanax.io import checkpointer  # pylint: disable=import-outside-toplevel
    # Orbax's own handler back first (earlier tests of this process switched it already), its
    # override warning left out of what is checked.
    type_handlers.register_type_handler(jax.Array, type_handlers.ArrayHandler(), override=True)
    capfd.readouterr()
    caplog.set_level("WARNING")
    caplog.clear()
    for _ in range(2):
        checkpointer._write_replicated_arrays_from_one_replica_per_host()  # pylint: disable=protected-access
    handler = type_handlers.get_type_handler(jax.Array)
    assert not handler._use_replica_parallel  # pylint: disable=protected-access
    assert "Type handler registry" not in capfd.readouterr().err + caplog.text
