"""The Weights & Biases logger with the real ``wandb`` package in offline mode (nothing leaves the
machine): the runs are read back from the ``.wandb`` files wandb writes under the trainer dir."""

import glob
import json
import os
import struct
import sys
import time

import pytest

from titanax import errors
from titanax.config import apply_overrides
from titanax.config.overrides import Override
from titanax.io.checkpointer import OrbaxCheckpoint
from titanax.observe.loggers import CSV
from titanax.observe.wandb_logger import RUN_ID_FILE, WandB

from tests.train import helpers

pytest.importorskip("wandb", reason="install the 'wandb' extra: pip install -e '.[wandb]'")
from wandb.proto import wandb_internal_pb2  # noqa: E402  pylint: disable=wrong-import-position

PROJECT = "titanax-tests"


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path, monkeypatch):
    """wandb offline and quiet, its own files under tmp_path, no credentials."""
    home = tmp_path / "wandb_home"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR",
                 "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home))
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID",
                 "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)


# --- Reading an offline run back -------------------------------------------------------------

def _records(path):
    """The protobuf records of a ``.wandb`` file: a ``:W&B`` header (magic 0xBEE1, version 0),
    then LevelDB log blocks of 32 KiB, each record split into chunks (crc32, length, type)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), path
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # A block's tail too short for a chunk header: padding.
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:  # Zero padding to the end of the block.
            pos += block - pos % block if pos % block else 0
            continue
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _finished_run_records(path, timeout_s=20.0):
    """The records of a finished run's file. wandb's service writes the file after ``finish()``
    returns (measured: ~10 ms later, the file holding only its header until then), so this waits
    for the run's exit record."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            records = _records(path)
        except Exception:  # pylint: disable=broad-except  (a file still being written)
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path}: no exit record after {timeout_s} s"
        time.sleep(0.02)


def _key(item):
    return "/".join(item.nested_key) if item.nested_key else item.key


def _offline_runs(trainer_dir):
    """Every offline run under ``trainer_dir/wandb``, oldest first: id, name, config, tags and
    history ({step: {metric: value}}, wandb's own ``_*`` keys left out)."""
    runs = []
    for path in glob.glob(os.path.join(trainer_dir, "wandb", "offline-run-*", "run-*.wandb")):
        run = {"history": {}, "config": {}}
        for record in _finished_run_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run.update(id=record.run.run_id, name=record.run.display_name,
                           project=record.run.project, tags=list(record.run.tags),
                           start=record.run.start_time.ToNanoseconds())
                run["config"].update({_key(i): json.loads(i.value_json)
                                      for i in record.run.config.update})
            elif kind == "config":
                run["config"].update({_key(i): json.loads(i.value_json)
                                      for i in record.config.update})
            elif kind == "history":
                row = run["history"].setdefault(record.history.step.num, {})
                row.update({_key(i): json.loads(i.value_json) for i in record.history.item
                            if not _key(i).startswith("_")})
        run["config"].pop("_wandb", None)
        runs.append(run)
    return sorted(runs, key=lambda r: r["start"])


# --- Through the engine ----------------------------------------------------------------------

def _engine(trainer_dir, *, fresh=False):
    """A tiny MNIST engine logging every step to W&B (and CSV), checkpointing every 2 steps."""
    cfg = helpers.mnist_engine(data=8).config.clone()
    cfg.log_every = 1
    cfg.loggers = [WandB.default_config().set(project=PROJECT, tags=("test",)),
                   CSV.default_config()]
    cfg.checkpoint = OrbaxCheckpoint.default_config().set(
        save_every_n_steps=2, async_save=False,
        resume="never" if fresh else "auto", overwrite=fresh)
    engine = cfg.instantiate()
    engine.trainer_dir = str(trainer_dir)
    return engine


def _train(engine, steps, first_batch=0):
    engine.fit(data=iter(helpers.mnist_batches()[first_batch:steps]), steps=steps)
    engine.close()


def test_engine_metrics_resume_and_a_fresh_run(tmp_path):
    first = _engine(tmp_path)
    _train(first, steps=4)
    runs = _offline_runs(str(tmp_path))
    assert len(runs) == 1
    run = runs[0]
    assert run["project"] == PROJECT and run["tags"] == ["test"]
    assert run["name"] == os.path.basename(str(tmp_path))  # The trainer dir's name.
    # The engine hands its whole config tree over.
    assert run["config"] == json.loads(json.dumps(first.config.to_json()))
    with open(tmp_path / RUN_ID_FILE, encoding="utf-8") as f:
        assert f.read().strip() == run["id"]
    # W&B step = train step: the compile time at step 0, then one row per step, whose loss is
    # the engine's own.
    assert sorted(run["history"]) == [0, 1, 2, 3, 4]
    assert set(run["history"][0]) == {"compile_time_s"}
    losses = [run["history"][step]["loss"] for step in (1, 2, 3, 4)]
    assert losses == [h["loss"] for h in first.history]
    assert {"learning_rate", "grad_norm"} <= set(run["history"][4])

    # A relaunch restores step 4 and continues the same W&B run.
    resumed = _engine(tmp_path)
    _train(resumed, steps=6, first_batch=4)
    runs = _offline_runs(str(tmp_path))
    assert len(runs) == 2 and runs[1]["id"] == run["id"]
    # (The compile time is logged at the step the relaunch starts from.)
    assert sorted(runs[1]["history"]) == [4, 5, 6]
    assert set(runs[1]["history"][4]) == {"compile_time_s"}
    assert [runs[1]["history"][s]["loss"] for s in (5, 6)] == \
        [h["loss"] for h in resumed.history]

    # A fresh run in the same directory: a new id; the old one is kept aside, not continued.
    fresh = _engine(tmp_path, fresh=True)
    _train(fresh, steps=2)
    runs = _offline_runs(str(tmp_path))
    assert len(runs) == 3 and runs[2]["id"] != run["id"]
    assert sorted(runs[2]["history"]) == [0, 1, 2]
    assert [runs[2]["history"][s]["loss"] for s in (1, 2)] == [h["loss"] for h in fresh.history]
    with open(tmp_path / RUN_ID_FILE, encoding="utf-8") as f:
        assert f.read().strip() == runs[2]["id"]
    kept = glob.glob(str(tmp_path / f"{RUN_ID_FILE}.*"))
    assert len(kept) == 1
    with open(kept[0], encoding="utf-8") as f:
        assert f.read().strip() == run["id"]


# --- The logger on its own -------------------------------------------------------------------

def test_the_run_config_is_the_whole_config_tree(tmp_path):
    engine_cfg = helpers.mnist_engine(data=8).config
    logger = WandB.default_config().set(project=PROJECT, name="named", group="g").instantiate(
        trainer_dir=str(tmp_path), run_config=engine_cfg)
    logger.start(step=0, total_steps=3)
    for step in (1, 2, 3):
        logger.log_dict({"loss": 1.0 / step}, step)
    logger.log_dict({"eval/accuracy": 0.5}, 3)  # Another event at the same step joins its row.
    logger.close()
    (run,) = _offline_runs(str(tmp_path))
    assert run["name"] == "named"
    assert run["config"] == json.loads(json.dumps(engine_cfg.to_json()))
    assert run["config"]["model"]["hidden_dims"] == [64]
    assert run["config"]["learner"]["optimizer"]["learning_rate"] == 1e-3
    assert run["config"]["loggers"] == []
    assert run["history"] == {1: {"loss": 1.0}, 2: {"loss": 0.5},
                              3: {"loss": 1.0 / 3, "eval/accuracy": 0.5}}


def test_without_start_the_directorys_run_goes_on(tmp_path):
    first = WandB(project=PROJECT, trainer_dir=str(tmp_path))
    first.start(step=0)
    first.log_dict({"loss": 2.0}, 1)
    first.close()
    later = WandB(project=PROJECT, trainer_dir=str(tmp_path))  # An evaluation outside fit().
    later.log_dict({"eval/loss": 1.5}, 1)
    later.close()
    runs = _offline_runs(str(tmp_path))
    assert [r["id"] for r in runs] == [runs[0]["id"]] * 2
    assert runs[1]["history"] == {1: {"eval/loss": 1.5}}


def test_dir_and_disabled_mode(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    logger = WandB(project=PROJECT, dir=str(elsewhere), trainer_dir=str(tmp_path / "run"))
    logger.start(step=0)
    logger.log_dict({"loss": 1.0}, 1)
    logger.close()
    assert [r["history"] for r in _offline_runs(str(elsewhere))] == [{1: {"loss": 1.0}}]
    assert os.path.isfile(tmp_path / "run" / RUN_ID_FILE)  # The id stays with the run.

    disabled = WandB(project=PROJECT, mode="disabled", trainer_dir=str(tmp_path / "off"))
    disabled.start(step=0)
    disabled.log_dict({"loss": 1.0}, 1)
    disabled.close()
    assert not os.path.exists(tmp_path / "off")


def test_without_wandb_installed_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError.
    logger = WandB(project=PROJECT, trainer_dir=str(tmp_path))
    with pytest.raises(errors.ConfigError) as info:
        logger.start(step=0)
    assert info.value.path == "loggers: WandB" and "wandb" in info.value.message
    assert info.value.suggestion.startswith("pip install 'titanax[wandb]'")


def test_an_unknown_mode_is_refused_naming_the_field():
    with pytest.raises(errors.ConfigTypeError) as info:
        WandB.default_config().set(project=PROJECT, mode="ofline")
    assert info.value.path == "mode" and "'offline'" in info.value.message
    cfg = helpers.mnist_engine(data=8).config.clone()
    cfg.loggers = [WandB.default_config().set(project=PROJECT)]
    with pytest.raises(errors.ConfigValidationError) as info:
        apply_overrides(cfg, [Override(path="loggers[0].mode", text="ofline")])
    assert "config.loggers[0].mode: cannot use 'ofline'" in str(info.value)
    with pytest.raises(errors.ConfigValidationError) as info:
        WandB.default_config().instantiate()
    assert "project: REQUIRED field not set" in str(info.value)


def test_sample_completions_are_a_table_at_their_step(tmp_path):
    """A sampling objective's samples (observe/samples.py) reach W&B as the table ``samples``
    at the step that trains on them, beside that step's metrics -- and samples.jsonl keeps
    them too."""
    from titanax.observe.samples import SampleLog  # pylint: disable=import-outside-toplevel
    logger = WandB(project=PROJECT, trainer_dir=str(tmp_path))
    logger.start(step=0)
    samples = SampleLog(trainer_dir=str(tmp_path), every=2, count=2, loggers=[logger])
    logger.log_dict({"reward": 0.25}, 1)
    samples.show(step=2, prompts=["2+2=", "3+3=", "4+4="], completions=["4", "7777", "8"],
                 rewards=[1.0, 0.0, 1.0])
    logger.log_dict({"reward": 0.5}, 2)
    logger.close()
    (run,) = _offline_runs(str(tmp_path))
    at_two = run["history"][2]  # (wandb flattens the table's reference: samples/<key>.)
    assert at_two["reward"] == 0.5 and at_two["samples/_type"] == "table-file"
    assert not any(k.startswith("samples") for k in run["history"][1])
    (table_file,) = glob.glob(os.path.join(str(tmp_path), "wandb", "offline-run-*", "files",
                                           at_two["samples/path"]))
    with open(table_file, encoding="utf-8") as f:
        table = json.load(f)
    assert table["columns"] == ["prompt", "completion", "reward"]
    assert table["data"] == [["2+2=", "4", 1.0], ["3+3=", "7777", 0.0]]
    with open(tmp_path / "samples.jsonl", encoding="utf-8") as f:
        assert [json.loads(line)["completion"] for line in f] == ["4", "7777"]
