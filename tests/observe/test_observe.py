"""Loggers, throughput / MFU helpers."""

import csv
import subprocess
import sys

import pytest

from titanax.observe import throughput
from titanax.observe.loggers import CSV, Basic, TensorBoard


def test_basic_logger_line(capsys):
    Basic().log_dict({"loss": 1.23456, "learning_rate": 3e-4, "grad_norm": 0.5,
                      "step_time_s": 0.1, "tokens_per_s": 12345.0, "eta_s": 3725.0}, 7)
    line = capsys.readouterr().out.strip()
    assert line == ("step      7  loss 1.2346  learning_rate 3.000e-04  grad_norm 0.5000  "
                    "step_time_s 0.1000  tokens_per_s 12345  eta 1:02:05")
    Basic().log_dict({"heldout/loss": 1.5}, 8)
    assert "heldout/loss 1.5000" in capsys.readouterr().out


def test_each_depth_and_each_moe_child_is_shown_by_its_name(capsys):
    """A DeepSeek-V3 run's line: the multi-token-prediction depths' losses after the loss, and
    the experts' load of the stack and of the prediction depth told apart (one alone keeps
    the short name)."""
    metrics = {"loss": 2.0, "mtp_loss/1": 2.5, "mtp_loss/2": 3.0, "learning_rate": 1e-3,
               "summaries/decoder/layer/mlp/expert_load/max": 1.5,
               "summaries/prediction/0/block/mlp/expert_load/max": 1.25}
    Basic().log_dict(metrics, 3)
    assert capsys.readouterr().out.strip() == (
        "step      3  loss 2.0000  mtp_loss/1 2.5000  mtp_loss/2 3.0000  learning_rate 0.0010  "
        "expert_load/max(decoder) 1.5000  expert_load/max(prediction) 1.2500")
    del metrics["summaries/prediction/0/block/mlp/expert_load/max"]
    Basic().log_dict(metrics, 4)
    assert capsys.readouterr().out.strip().endswith("expert_load/max 1.5000")


def test_progress_line_shows_step_of_total(capsys):
    logger = Basic()
    logger.start(step=0, total_steps=200)
    logger.log_dict({"loss": 1.0}, 10)
    assert capsys.readouterr().out.startswith("step     10/200  loss 1.0000")


def test_the_objectives_metrics_lead_the_progress_line_unless_switched_off(capsys):
    """A run's objective names what it is judged by (GRPO: reward first, its ~0 loss after);
    the metrics it names but a step lacks are left out, none shown twice."""
    from titanax.objectives.grpo import GRPO  # pylint: disable=import-outside-toplevel
    metrics = {"loss": 1e-8, "reward": 0.75, "reward_std": 0.25, "learning_rate": 1e-3,
               "entropy": 1.5, "completions/clipped_ratio": 0.0}
    logger = Basic()
    logger.console_columns = GRPO.console_columns
    logger.log_dict(metrics, 3)
    assert capsys.readouterr().out.strip() == (
        "step      3  reward 0.7500  reward_std 0.2500  entropy 1.5000  loss 1.000e-08  "
        "learning_rate 0.0010")
    quiet = Basic.default_config().set(objective_columns=False).instantiate()
    quiet.console_columns = GRPO.console_columns
    quiet.log_dict(metrics, 3)
    assert capsys.readouterr().out.strip() == "step      3  loss 1.000e-08  learning_rate 0.0010"


def test_csv_is_one_table_and_a_resume_does_not_duplicate_rows(tmp_path):
    logger = CSV(trainer_dir=str(tmp_path))
    logger.start(step=0, total_steps=30)
    for step in (10, 20, 30):
        logger.log_dict({"loss": 3.0 - step / 10}, step)
    logger.log_dict({"heldout/loss": 0.5}, 30)  # A column that appears later.
    resumed = CSV(trainer_dir=str(tmp_path))
    resumed.start(step=20, total_steps=40, resumed=True)  # Restored at 20: 30 runs again.
    for step in (30, 40):
        resumed.log_dict({"loss": 0.1}, step)
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "loss", "heldout/loss"]
    assert [r[0] for r in rows[1:]] == ["10", "20", "30", "40"]
    assert all(len(r) == 3 for r in rows)
    fresh = CSV(trainer_dir=str(tmp_path))
    fresh.start(step=0, total_steps=10)  # A new run moves the old table aside, kept.
    fresh.log_dict({"loss": 9.0}, 1)
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        assert list(csv.reader(f)) == [["step", "loss"], ["1", "9.0"]]
    kept = [p for p in tmp_path.iterdir()
            if p.name.startswith("metrics.") and p.name != "metrics.csv"]
    assert len(kept) == 1


def test_csv_and_tensorboard_write_files(tmp_path):
    logger = CSV(trainer_dir=str(tmp_path))
    logger.log_dict({"loss": 2.0}, 1)
    logger.log_dict({"loss": 1.0}, 2)
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:
        assert list(csv.reader(f)) == [["step", "loss"], ["1", "2.0"], ["2", "1.0"]]
    board = TensorBoard(trainer_dir=str(tmp_path))
    board.log_dict({"loss": 1.0}, 1)
    board.close()
    assert list((tmp_path / "tensorboard").iterdir())


def _scalars(log_dir):
    """``{(tag, step): value}`` read back from the event files (TFRecord frames of Event
    protos: length, its CRC, the record, its CRC)."""
    from tensorboardX.proto.event_pb2 import Event  # pylint: disable=import-outside-toplevel
    found = {}
    for path in sorted(log_dir.iterdir()):
        data = path.read_bytes()
        while data:
            length = int.from_bytes(data[:8], "little")
            event = Event.FromString(data[12:12 + length])
            data = data[12 + length + 4:]
            for value in event.summary.value:
                found[(value.tag, event.step)] = value.simple_value
    return found


def test_tensorboard_events_hold_the_scalars_and_the_writer_leaves_torch_unloaded(tmp_path):
    """The event files read back as logged; tensorboardX is imported without torch (installed
    here, for the transformers references), which it would load only to accept torch tensors,
    and torch still imports normally afterwards."""
    script = (
        "import sys\n"
        "from titanax.observe.loggers import TensorBoard\n"
        f"board = TensorBoard(trainer_dir={str(tmp_path)!r})\n"
        "board.log_dict({'loss': 2.5, 'heldout/loss': 3.25}, 1)\n"
        "board.log_dict({'loss': 1.5}, 2)\n"
        "board.close()\n"
        "print('torch loaded:', 'torch' in sys.modules)\n"
        "import torch\n"
        "print('torch then:', torch.ones(2).sum().item())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["torch loaded: False", "torch then: 2.0"]
    assert _scalars(tmp_path / "tensorboard") == {("loss", 1): 2.5, ("heldout/loss", 1): 3.25,
                                                  ("loss", 2): 1.5}


def test_peak_table_and_mfu():
    class FakeDevice:
        device_kind = "NVIDIA H100 80GB HBM3"

    assert throughput.peak_flops(FakeDevice()) == 989e12
    assert throughput.mfu(989e12 * 0.5, 1.0, FakeDevice()) == pytest.approx(0.5)
    assert throughput.mfu(1e12, 1.0) is None  # CPU: peak unknown, MFU not guessed.
