"""The flags every model-loading command shares (``command_line.check_model_source_flags``:
``titanax.evaluate`` and ``titanax.generate`` refuse alike), each refusal naming its flag."""

import types

import pytest

from titanax import command_line, errors

GOOD = dict(trainer_dir=None, hf="model_dir", step=None, model_parallel=1, cpu_devices=None)


@pytest.mark.parametrize("command", ["evaluate", "generate"])
@pytest.mark.parametrize("changes,path", [
    ({"hf": None}, "--trainer_dir/--hf"),
    ({"trainer_dir": "run"}, "--trainer_dir/--hf"),
    ({"step": 3}, "--step"),
    ({"hf": None, "trainer_dir": "run", "model_parallel": 2}, "--model_parallel"),
    ({"hf": None, "trainer_dir": "run", "step": -1}, "--step"),
    ({"model_parallel": 0}, "--model_parallel"),
    ({"cpu_devices": 0}, "--cpu_devices"),
])
def test_model_source_flags_are_refused_by_name(command, changes, path):
    with pytest.raises(errors.LaunchFlagError) as info:
        command_line.check_model_source_flags(types.SimpleNamespace(**dict(GOOD, **changes)),
                                              command=command)
    assert info.value.path == path


def test_good_model_source_flags_pass():
    command_line.check_model_source_flags(types.SimpleNamespace(**GOOD), command="generate")
    command_line.check_model_source_flags(types.SimpleNamespace(
        **dict(GOOD, hf=None, trainer_dir="run", step=4)), command="evaluate")
    with pytest.raises(errors.LaunchFlagError, match="2\\*\\*32"):
        command_line.check_seed_flag(2 ** 32)
