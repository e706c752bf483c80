"""Nothing the user saved is lost, overwritten or mixed with another run (DESIGN section 8).

Each test is one way a run used to lose data silently: a fresh run saving into another run's
directory, a damaged step directory blocking every later save, an old ZeRO-1 optimizer state of flat
chunks restored onto today's layout, and Orbax refusing a save that nobody checked.
"""

import glob
import os

import jax
import numpy as np
import pytest

from titanax import errors
from titanax.data.pipeline import Input
from titanax.data.sources import MNIST, TextWindows
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.train.state_manager import check_state_layout
from tests import forked_python
from tests.train import helpers


def _host(tree):
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def _mnist(path, **checkpoint):
    return helpers.mnist_engine(
        data=8, train_input=Input.default_config().set(source=MNIST.default_config(),
                                                       global_batch_size=64, seed=3),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(path), save_every_n_steps=10,
                                                        **checkpoint))


def _assert_same(tree_a, tree_b):
    for got, want in zip(jax.tree_util.tree_leaves(tree_a), jax.tree_util.tree_leaves(tree_b)):
        np.testing.assert_array_equal(got, want)


def _finished_run(path):
    """A run of 10 steps saved in ``path``; returns its final params (host)."""
    old = _mnist(path)
    old.fit(steps=10)
    old.close()
    return _host(old.state.params)


def test_fresh_run_refuses_a_directory_holding_another_runs_checkpoints(tmp_path):
    path = tmp_path / "ckpt"
    old_params = _finished_run(path)
    fresh = _mnist(path, resume="never")
    with pytest.raises(errors.CheckpointError) as info:
        fresh.fit(steps=10)
    assert info.value.path == str(path) and "overwrite" in info.value.suggestion
    assert "--trainer_dir" in info.value.suggestion and not fresh.history  # Nothing trained.
    by_hand = _mnist(path)  # The "no model" advice of wave 1: init_state() by hand, then fit.
    by_hand.init_state()
    with pytest.raises(errors.CheckpointError):
        by_hand.fit(steps=10)
    _assert_same(_host(OrbaxCheckpoint(str(path)).load(10)), old_params)  # Untouched.


def test_overwrite_moves_the_old_checkpoints_aside_and_keeps_them(tmp_path):
    path = tmp_path / "ckpt"
    old_params = _finished_run(path)
    new = helpers.mnist_engine(
        data=8, train_input=Input.default_config().set(source=MNIST.default_config(),
                                                       global_batch_size=64, seed=4),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(path), save_every_n_steps=10,
                                                        resume="never", overwrite=True),
        seed=1)
    new.fit(steps=10)
    new.close()
    aside = glob.glob(f"{path}.superseded-*")
    assert len(aside) == 1
    _assert_same(_host(OrbaxCheckpoint(aside[0]).load(10)), old_params)
    _assert_same(_host(OrbaxCheckpoint(str(path)).load(10)), _host(new.state.params))
    assert not np.allclose(old_params["dense0"]["weight"],
                           _host(new.state.params)["dense0"]["weight"])


def test_damaged_step_directory_is_moved_aside_and_later_saves_go_through(tmp_path):
    path = tmp_path / "ckpt"
    _mnist(path).fit(steps=20)
    os.makedirs(path / "40")  # An empty leftover, "newer" than every real step.
    with open(path / "40" / "junk", "w", encoding="utf-8") as f:
        f.write("not a checkpoint")
    resumed = _mnist(path)
    resumed.fit(steps=30)
    assert resumed.restored_from.endswith("/20")
    ckpt = resumed.checkpointer()
    assert ckpt.all_steps() == [10, 20, 30]  # Step 30 really was saved.
    aside = glob.glob(str(path / "40.damaged-*"))
    assert len(aside) == 1 and os.listdir(aside[0]) == ["junk"]  # Kept for inspection.
    _assert_same(_host(OrbaxCheckpoint(str(path)).load(30)), _host(resumed.state.params))


def test_a_save_orbax_would_skip_is_an_error_never_a_no_op(tmp_path):
    path = tmp_path / "ckpt"
    engine = _mnist(path)
    engine.fit(steps=20)
    other = OrbaxCheckpoint(str(path))  # Another run's checkpointer on the same directory.
    with pytest.raises(errors.CheckpointError) as info:
        other.save(engine.state, 20)
    assert "not written by this run" in info.value.message
    with pytest.raises(errors.CheckpointError) as info:
        other.save(engine.state, 15)
    assert "newer step(s) [20]" in info.value.message
    assert engine.save() is False  # This run's own step 20: nothing to do, and said so.


def _gpt(path, data, model_axis, **changes):
    return helpers.gpt_engine(
        data=data, model_axis=model_axis, zero=True,
        train_input=Input.default_config().set(
            source=TextWindows.default_config().set(seq_len=16), global_batch_size=8, seed=5),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(path), save_every_n_steps=5),
        **changes)


def test_zero1_flat_chunks_of_an_older_checkpoint_are_refused_naming_the_mesh(tmp_path):
    """Checkpoints written before ZeRO sharded along real dimensions hold flattened, padded
    chunks cut for their mesh: restored into today's layout they would load and mean other
    numbers, so a full restore refuses them (params-only restores still work)."""
    saved = {"optimizer_state_layout": {"kind": "zero1_flat_chunks",
                                        "mesh": {"data": 4, "model": 2}}}
    with pytest.raises(errors.CheckpointError) as info:
        check_state_layout(saved, where=f"{tmp_path}/5")
    assert info.value.path.endswith("/5/train_state")
    assert "data=4 x model=2" in info.value.message
    assert "restore_mode=params" in info.value.suggestion
    check_state_layout({"optimizer_state_layout": {"kind": "param_layout"}},
                       where=f"{tmp_path}/5")
    unrecorded = {"config": "mesh.axes: ('data', 'model')\nplan.zero.stage: 1\n",
                  "mesh_axes": ["data", "model"], "mesh_shape": [4, 2]}  # Wave 1's metadata.
    with pytest.raises(errors.CheckpointError) as info:
        check_state_layout(unrecorded, where=f"{tmp_path}/5")
    assert "data=4 x model=2" in info.value.message
    check_state_layout({"config": "plan.zero: None\n"}, where=f"{tmp_path}/5")


def test_resume_states_how_the_config_differs_from_the_checkpoints(tmp_path, capsys):
    _mnist(tmp_path).fit(steps=10)
    capsys.readouterr()
    changed = helpers.mnist_engine(
        data=8, learner=helpers.adam(2e-3),
        train_input=Input.default_config().set(source=MNIST.default_config(),
                                               global_batch_size=64, seed=3),
        checkpoint=OrbaxCheckpoint.default_config().set(path=str(tmp_path),
                                                        save_every_n_steps=10))
    assert changed.restore()
    out = capsys.readouterr().out
    assert "differs from the one saved with step 10 (1 change)" in out
    assert "learner.optimizer.learning_rate: 0.001 -> 0.002" in out


def test_unreadable_checkpoints_never_restart_the_run_from_step_0(tmp_path):
    path = tmp_path / "ckpt"
    os.makedirs(path / "40")  # Only a damaged step: no older one to fall back to.
    engine = _mnist(path)
    with pytest.raises(errors.CheckpointError) as info:
        engine.fit(steps=10)
    assert "no checkpoint here could be read" in info.value.message
    assert info.value.path == str(path) and not engine.history
    assert os.listdir(path) == ["40"]  # Nothing moved, nothing trained over it.


def test_a_failed_save_ends_the_launcher_instead_of_hanging(tmp_path):
    """Made in Orbax's background threads, a step's directories outlived a save that failed:
    the threads waited for them (their timeout: 20 minutes), and the interpreter for the
    threads at exit. The launcher must end with the error, exit status 2."""
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel
    import time  # pylint: disable=import-outside-toplevel
    from tests.environment import child_environment  # pylint: disable=import-outside-toplevel
    started = time.monotonic()
    result = forked_python.run(
        ["-m", "titanax.launch", "--config_module=tests.io.failing_save_experiment",
         "--config=failing_save", f"--trainer_dir={tmp_path}", "--config.max_steps=2",
         "--cpu_devices=2"], env=child_environment(),
        timeout=300)
    assert result.returncode == 2 and "saving step 2 failed" in result.stderr, result.stderr
    assert time.monotonic() - started < 150, "the launcher waited for background threads"
