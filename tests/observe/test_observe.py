"""Loggers, throughput / MFU helpers."""

import csv

import pytest

from titanax.observe import throughput
from titanax.observe.loggers import CSV, Basic, TensorBoard


def test_basic_logger_line(capsys):
    Basic().log_dict({"loss": 1.23456, "learning_rate": 3e-4, "grad_norm": 0.5,
                      "step_time_s": 0.1, "tokens_per_s": 12345.0, "eta_s": 3725.0}, 7)
    line = capsys.readouterr().out.strip()
    assert line == ("step      7  loss 1.2346  learning_rate 3.000e-04  grad_norm 0.5000  "
                    "step_time_s 0.1000  tokens_per_s 1.234e+04  eta 1:02:05")
    Basic().log_dict({"heldout/loss": 1.5}, 8)
    assert "heldout/loss 1.5000" in capsys.readouterr().out


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


def test_peak_table_and_mfu():
    class FakeDevice:
        device_kind = "NVIDIA H100 80GB HBM3"

    assert throughput.peak_flops(FakeDevice()) == 989e12
    assert throughput.mfu(989e12 * 0.5, 1.0, FakeDevice()) == pytest.approx(0.5)
    assert throughput.mfu(1e12, 1.0) is None  # CPU: peak unknown, MFU not guessed.
