"""End-to-end tests of `python -m titanax.launch` (run as real subprocesses)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests import forked_python
from tests.environment import child_environment

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Launches without --cpu_devices get the session's 8 devices; see tests/environment.py.
ENV = child_environment(keep_device_count=True, quick_backend=True)
FIXTURES = "--config_module=tests.config.fixture_experiments"


def _launch(*args, timeout=120):
    return forked_python.run(["-m", "titanax.launch", *args], cwd=REPO_ROOT,
                             env=ENV, timeout=timeout)


def test_list_shows_registered_experiments_with_summaries():
    result = _launch("--list", FIXTURES)
    assert result.returncode == 0, result.stderr
    assert "mnist_dp" in result.stdout and "gpt_tiny_dp_tp" in result.stdout
    assert any(line.split(None, 1) == ["fixture_model", "A fixture experiment with nested fields "
               "of many types."] for line in result.stdout.splitlines())


def test_print_config_shows_override_and_one_line_diff(tmp_path):
    result = _launch("--config=fixture_model", FIXTURES, "--config.decoder.num_heads=16",
                     "--print_config", f"--trainer_dir={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "decoder.num_heads: 16\n" in result.stdout
    assert result.stdout.endswith("# diff from fixture_model (1 change)\n"
                                  "decoder.num_heads: 4 -> 16\n")
    saved = (tmp_path / "config.txt").read_text()
    assert "decoder.num_heads: 16\n" in saved
    assert json.loads((tmp_path / "config.json").read_text())["decoder"]["num_heads"] == 16
    assert (tmp_path / "config_diff.txt").read_text() == "decoder.num_heads: 4 -> 16\n"


def test_misspelled_override_fails_with_path_and_suggestion_without_traceback():
    result = _launch("--config=fixture_model", FIXTURES, "--config.decoder.num_haeds=1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "config.decoder.num_haeds" in result.stderr
    assert "did you mean 'num_heads'" in result.stderr
    assert len(result.stderr.splitlines()) < 20


def test_wrong_typed_override_names_expected_type():
    result = _launch("--config=fixture_model", FIXTURES, "--config.decoder.dropout_rate=high")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "config.decoder.dropout_rate: cannot use 'high': expected a float" in result.stderr


def test_missing_required_field_and_unknown_experiment():
    result = _launch("--config=fixture_incomplete", FIXTURES, "--print_config")
    assert result.returncode == 2
    assert "decoder.num_heads: REQUIRED field not set" in result.stderr
    result = _launch("--config=fixture_modl", FIXTURES)
    assert result.returncode == 2 and "did you mean 'fixture_model'" in result.stderr


def test_runs_the_experiment_root():
    result = _launch("--config=fixture_model", FIXTURES, "--config.decoder.num_heads=3")
    assert result.returncode == 0, result.stderr
    assert "running fixture model with 3 heads" in result.stdout


@pytest.mark.parametrize("flags,message", [
    (["--num_processes=2"], "--coordinator_address"),
    (["--coordinator_address=localhost:1", "--num_processes=2", "--process_id=2"],
     "--process_id: must be in [0, 2)"),
    (["--coordinator_address=localhost", "--num_processes=2", "--process_id=0"],
     "--coordinator_address: must be host:port"),
    (["--cpu_devices=0"], "--cpu_devices: must be a positive int"),
])
def test_bad_launch_flags(flags, message):
    result = _launch("--config=fixture_model", FIXTURES, *flags)
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr


def test_show_traceback_flag():
    result = _launch("--config=nope", "--show_traceback")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_config_package_does_not_import_jax():
    code = ("import sys, titanax, titanax.config, titanax.config.golden, titanax.runtime.cluster;"
            "import titanax.runtime.cpu_devices;"
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')];"
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_explain_prints_mesh_layouts_and_collectives(tmp_path):
    result = _launch("--config=mnist_dp", "--cpu_devices=8", "--explain",
                     f"--trainer_dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh data=8: 8 cpu device(s)" in result.stdout
    assert "dense0/weight" in result.stdout and "P(None, None)" in result.stdout
    assert "collectives of the train step:" in result.stdout
    assert "all-reduce  data" in result.stdout


def test_explain_compiles_from_shapes_a_model_that_would_not_fit_this_machine(tmp_path):
    """60 GiB of params (a train state of 120 GiB per device), on a machine of 24 GiB: --explain
    reads the first batch but allocates no state -- the step is compiled on the state's shapes."""
    result = _launch("--config=llama_tiny_dp_tp", "--cpu_devices=8", "--explain",
                     "--config.model.model_dim=16384", "--config.model.hidden_dim=65536",
                     "--config.evalers={}", f"--trainer_dir={tmp_path}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "total: 11 params, 60.0 GiB global, 30.0 GiB per device" in result.stdout
    assert re.search(r"total +120\.1 GiB", result.stdout), result.stdout[-3000:]
    assert "collectives of the train step:" in result.stdout
    assert "all-reduce  data" in result.stdout


def test_explain_of_a_sampling_objective_shows_and_writes_no_samples(tmp_path):
    """--explain samples one rollout for the shapes of the step it compiles: no samples shown,
    no samples.jsonl left where a later run would append its own."""
    result = _launch("--config=llama_tiny_grpo", "--cpu_devices=8", "--explain",
                     f"--trainer_dir={tmp_path / 'run'}", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "collectives of the train step:" in result.stdout
    assert "samples at step" not in result.stdout, result.stdout[:3000]
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_explain_warns_of_prompts_and_rows_their_windows_cut(tmp_path):
    """What the data loses to the configured lengths is a warning before anything runs: text
    prompts past max_prompt_tokens (GRPO) and documents past seq_len (SFT rows)."""
    prompts = _launch("--config=llama_tiny_grpo", "--cpu_devices=8", "--explain",
                      "--config.train_input.source.max_prompt_tokens=3",
                      f"--trainer_dir={tmp_path / 'grpo'}", timeout=300)
    assert prompts.returncode == 0, prompts.stderr[-3000:]
    assert "titanax: warning: 55 of the train split's 55 prompts are longer than " \
           "max_prompt_tokens=3" in prompts.stdout + prompts.stderr
    (tmp_path / "long.jsonl").write_text("".join(
        json.dumps({"prompt": "Question " * 20 + str(i), "completion": " answer."}) + "\n"
        for i in range(40)))
    rows = _launch("--config=llama_tiny_sft", "--cpu_devices=8", "--explain",
                   f"--config.train_input.source.files=['{tmp_path / 'long.jsonl'}']",
                   "--config.train_input.source.seq_len=32", "--config.train_input.global_batch_size=8",
                   f"--trainer_dir={tmp_path / 'sft'}", timeout=300)
    assert rows.returncode == 0, rows.stderr[-3000:]
    assert re.search(r"titanax: warning: train split: .* 36 longer than a row truncated",
                     rows.stdout + rows.stderr), rows.stdout[-3000:]


def test_a_users_experiments_package_does_not_hide_the_built_in_ones(tmp_path):
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "__init__.py").write_text(
        "from titanax.config import register_experiment\n"
        "from titanax_experiments.mnist import mnist_dp\n\n"
        "@register_experiment\n"
        "def users_own():\n"
        '    """A user\'s experiment."""\n'
        "    return mnist_dp()\n")
    script = os.path.join(os.path.dirname(sys.executable), "titanax-launch")
    for command in ([sys.executable, "-m", "titanax.launch"], [script]):
        result = subprocess.run([*command, "--list", "--config_module=experiments"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60,
                                check=False)
        assert result.returncode == 0, result.stderr
        names = [line.split()[0] for line in result.stdout.splitlines()]
        assert {"mnist_dp", "gpt_tiny_dp", "users_own"} <= set(names), (command, names)


def test_installed_script_lists_its_flags_in_help():
    script = os.path.join(os.path.dirname(sys.executable), "titanax-launch")
    result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0  # Help is not an error (absl alone would exit 1).
    for flag in ("--config:", "--cpu_devices:", "--trainer_dir:", "--[no]explain:", "--[no]list:"):
        assert flag in result.stdout, flag


def test_optional_parts_switch_on_and_off_from_flags():
    result = _launch("--config=gpt_tiny_dp", "--config.plan.zero.stage=1",
                     "--config.plan.tensor_parallel.axis=model", "--print_config")
    assert result.returncode == 0, result.stderr
    assert "plan.zero.stage: 1" in result.stdout
    assert "plan.tensor_parallel.axis: 'model'" in result.stdout
    result = _launch("--config=gpt_tiny_dp", "--config.plan.zero.stage=1",
                     "--config.plan.zero=None", "--print_config")
    assert result.returncode == 0 and "plan.zero: None" in result.stdout
    result = _launch("--config=gpt_tiny_dp", "--config.learner.optimizer.learning_rate=1e-3",
                     "--print_config")  # A constant replaces the schedule.
    assert result.returncode == 0 and "learner.optimizer.learning_rate: 0.001" in result.stdout


def test_decay_steps_follow_max_steps():
    from titanax.config import registry  # pylint: disable=import-outside-toplevel
    from titanax.config import overrides  # pylint: disable=import-outside-toplevel
    registry.load_config_modules(registry.DEFAULT_CONFIG_MODULES)
    cfg = overrides.apply_overrides(registry.get_config("gpt_tiny_dp"),
                                    [overrides.Override("max_steps", "200")])
    learner = cfg.learner.instantiate(total_steps=cfg.max_steps)
    assert learner.learning_rate(200) < learner.learning_rate(150) < learner.learning_rate(100)
    peak = cfg.learner.optimizer.learning_rate.peak_value
    assert abs(float(learner.learning_rate(200)) - peak / 10) < 1e-7  # end_value at max_steps.


def test_a_config_file_applies_before_the_command_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("decoder:\n  num_heads: 8\n")
    both = _launch("--config=fixture_model", FIXTURES, f"--config_file={path}", "--print_config")
    assert both.returncode == 0, both.stderr
    assert "decoder.num_heads: 4 -> 8" in both.stdout
    wins = _launch("--config=fixture_model", FIXTURES, f"--config_file={path}",
                   "--config.decoder.num_heads=16", "--print_config")
    assert "decoder.num_heads: 4 -> 16" in wins.stdout, wins.stdout + wins.stderr


@pytest.mark.parametrize("args,text", [
    (["--local_processes=0"], "must be >= 1"),
    (["--local_processes=2", "--num_processes=2", "--process_id=0",
      "--coordinator_address=127.0.0.1:1234"], "already in one"),
])
def test_bad_local_process_flags_are_refused_before_anything_starts(args, text):
    result = _launch("--config=gpt_tiny_dp", *args)
    assert result.returncode == 2 and "--local_processes" in result.stderr and \
        text in result.stderr, result.stderr


def test_local_processes_without_devices_names_cpu_devices():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    result = forked_python.run(["-m", "titanax.launch", "--config=gpt_tiny_dp",
                                "--local_processes=2"], cwd=REPO_ROOT, timeout=120, env=env)
    assert result.returncode == 2 and "--cpu_devices=K" in result.stderr, result.stderr


def test_the_first_failing_process_stops_the_job_and_is_named():
    env = child_environment()
    result = forked_python.run(["-m", "titanax.run",
                                "--module=tests.runtime.user_main:fail_in_one",
                                "--local_processes=2", "--cpu_devices=1"], cwd=REPO_ROOT, timeout=180,
                               env=env)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "process 1 of 2 failed with exit status 1; stopped the other processes" in \
        result.stderr
    assert "[1] RuntimeError: a user error in process 1" in result.stdout


def test_compile_only_prints_memory_per_device_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = _launch("--config=llama_tiny_dp_tp", "--cpu_devices=8", "--compile_only",
                     f"--trainer_dir={run_dir}", "--config.mesh.shape=(8,1)",
                     "--config.train_input.global_batch_size=8", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report) == {"temp_bytes", "argument_bytes", "output_bytes", "alias_bytes",
                           "peak_bytes"}
    assert all(isinstance(v, int) and v >= 0 for v in report.values())
    assert report["peak_bytes"] == (report["argument_bytes"] + report["output_bytes"]
                                    + report["temp_bytes"] - report["alias_bytes"])
    assert report["argument_bytes"] > 0 and report["temp_bytes"] > 0
    assert "compiled the train step for 8 devices (data 8 x model 1)" in result.stdout
    assert not run_dir.exists()  # No run record, no checkpoint directory.
    both = _launch("--config=llama_tiny_dp_tp", "--cpu_devices=8", "--compile_only", "--explain",
                   f"--trainer_dir={run_dir}")
    assert both.returncode != 0 and "--compile_only" in both.stderr
