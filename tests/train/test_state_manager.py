"""What a restore on another layout says: the processes and mesh saved vs now, and how each
data shard's part of the global batch changed (the accumulation that keeps its memory)."""

import numpy as np
from jax.sharding import Mesh

from titanax.io.checkpointer import Restored
from titanax.train.state_manager import _report_layout_change

import jax


def _restored(shape, axes, processes=1):
    return Restored(step=12, params=None, train_state=None, data_state=None, path="/ckpt/12",
                    metadata={"mesh_shape": list(shape), "mesh_axes": list(axes),
                              "process_count": processes})


def _mesh(data, model):
    devices = np.array(jax.devices()[:data * model]).reshape(data, model)
    return Mesh(devices, ("data", "model"))


def test_fewer_data_shards_are_said_with_the_accumulation_that_keeps_memory(capsys):
    _report_layout_change(_restored((4, 2), ("data", "model"), processes=2), mesh=_mesh(2, 2),
                          batch_axes=("data",))
    out = capsys.readouterr().out
    assert ("step 12 was saved on 2 processes, mesh data=4 x model=2 (8 devices); the run "
            "continues on 1 process, mesh data=2 x model=2 (4 devices)") in out, out
    assert "each of the 2 data shards (was 4) takes 2x the rows" in out, out
    assert "accumulate_steps 2x the saved run's" in out, out


def test_more_data_shards_or_the_same_layout_say_no_accumulation(capsys):
    _report_layout_change(_restored((2, 2), ("data", "model")), mesh=_mesh(4, 2),
                          batch_axes=("data",))
    out = capsys.readouterr().out
    assert "continues on 1 process, mesh data=4 x model=2" in out and "accumulate" not in out, out
    _report_layout_change(_restored((4, 2), ("data", "model")), mesh=_mesh(4, 2),
                          batch_axes=("data",))
    assert capsys.readouterr().out == ""
