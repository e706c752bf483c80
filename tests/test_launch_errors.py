"""Every bad input of docs/troubleshooting.md's table, through the real launcher (its flag
parsing and main; the table's cases in one child process, tests/launch_cases.py).

Each must end with exit status 2, a message naming the path (config path, flag or mesh axis) and
no Python traceback; none may hang. Ctrl-C in the first seconds must exit 0 without a traceback.
"""

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import forked_python
from tests.environment import child_environment
from tests.launch_cases import launch_in_one_child

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Launches without --cpu_devices get the session's 8 devices; see tests/environment.py.
ENV = child_environment(keep_device_count=True, quick_backend=True)
LAUNCH = [sys.executable, "-m", "titanax.launch"]


def _launch(*args, timeout=180, cwd=REPO_ROOT):
    return forked_python.run([*LAUNCH[1:], *args], cwd=cwd, env=ENV, timeout=timeout)


# (case id, launcher arguments, text the message must contain: the path). "{tmp}" is a fresh
# directory and "{file}" a file in it. A case that trained before it was refused has
# --config.max_steps=1: should its guard go, it trains one step and fails here, not for hours.
BAD_INPUTS = [
    ("trainer_dir is a file", ["--config=mnist_dp", "--trainer_dir={file}"], "--trainer_dir"),
    ("trainer_dir under a file", ["--config=mnist_dp", "--trainer_dir={file}/run"],
     "--trainer_dir"),
    ("trainer_dir not writable (new)", ["--config=mnist_dp", "--trainer_dir=/proc/titanax-run"],
     "--trainer_dir"),
    ("trainer_dir not writable (existing)", ["--config=mnist_dp", "--trainer_dir=/proc/self"],
     "--trainer_dir"),
    ("negative model_dim", ["--config=gpt_tiny_dp", "--config.model.model_dim=-128"],
     "model.model_dim"),
    ("zero layers", ["--config=gpt_tiny_dp", "--config.model.num_layers=0"], "model.num_layers"),
    ("dropout rate 5", ["--config=gpt_tiny_dp", "--config.model.dropout_rate=5"],
     "model.dropout_rate"),
    ("evaler addressed as a field", ["--config=gpt_tiny_dp",
                                     "--config.evalers.heldout.every_n_steps=3"],
     "evalers['heldout']"),
    ("100000 CPU devices", ["--config=mnist_dp", "--cpu_devices=100000"], "--cpu_devices"),
    ("two slices in one process", ["--config=llama_tiny_dp_tp", "--trainer_dir={tmp}/run",
                                   "--config.max_steps=1", "--config.mesh.dcn_shape=(2,1)"],
     "mesh.dcn_shape"),
    ("dcn_shape of another length", ["--config=llama_tiny_dp_tp",
                                     "--config.mesh.dcn_shape=(2,)"], "mesh.dcn_shape"),
    ("local tier in a directory that cannot be written",
     ["--config=mnist_dp", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.checkpoint.local_dir=/proc/titanax-local",
      "--config.checkpoint.local_every_n_steps=2"], "checkpoint.local_dir"),
    ("local tier every 0 steps", ["--config=mnist_dp", "--config.checkpoint.local_dir={tmp}/l",
                                  "--config.checkpoint.local_every_n_steps=0"],
     "checkpoint.local_every_n_steps"),
    ("local tier without a directory", ["--config=mnist_dp",
                                        "--config.checkpoint.local_every_n_steps=5"],
     "checkpoint.local_every_n_steps"),
    ("--emit with an unknown target", ["--config=mnist_dp", "--emit=helm"], "--emit"),
    ("--emit with an empty image", ["--config=mnist_dp", "--emit=jobset", "--image="],
     "--image"),
    ("local tier in an empty directory name",
     ["--config=mnist_dp", "--config.checkpoint.local_dir=",
      "--config.checkpoint.local_every_n_steps=2"], "checkpoint.local_dir"),
    ("--emit for zero nodes", ["--config=mnist_dp", "--emit=slurm", "--nodes=0"], "--nodes"),
    ("--nodes without --emit", ["--config=mnist_dp", "--nodes=2"], "--nodes"),
    ("--emit with --local_processes",
     ["--config=mnist_dp", "--emit=jobset", "--local_processes=2", "--cpu_devices=4"],
     "--local_processes"),
    ("--emit for a job whose devices the mesh does not fit",
     ["--config=llama_tiny_dp_tp", "--emit=slurm", "--nodes=1", "--devices_per_node=3"],
     "mesh.shape"),
    ("zero learning rate", ["--config=mnist_dp", "--config.learner.optimizer.learning_rate=0"],
     "learner.optimizer.learning_rate"),
    ("negative peak learning rate",
     ["--config=gpt_tiny_dp", "--config.learner.optimizer.learning_rate.peak_value=-1e-3"],
     "learner.optimizer.learning_rate.peak_value"),
    ("negative max_steps", ["--config=mnist_dp", "--config.max_steps=-5"], "max_steps"),
    ("data axis None", ["--config=mnist_dp", "--config.plan.data_parallel.axis=None"],
     "plan.data_parallel.axis"),
    ("fp16 without loss scaling", ["--config=gpt_tiny_dp", "--config.precision.fp16=true"],
     "precision.loss_scaling"),
    ("evaler num_batches 0", ["--config=mnist_dp", "--config.evalers['test'].num_batches=0"],
     "evalers['test'].num_batches"),
    ("eval batch does not split", ["--config=mnist_dp", "--trainer_dir={tmp}/run",
                                   "--config.evalers['test'].input.global_batch_size=12"],
     "evalers['test'].input.global_batch_size"),
    ("mesh larger than the machine", ["--config=gpt_tiny_dp_tp", "--trainer_dir={tmp}/run",
                                      "--config.mesh.shape=(8,4)"], "--cpu_devices=32"),
    ("TP switched on without a model axis", ["--config=gpt_tiny_dp", "--trainer_dir={tmp}/run",
                                             "--config.plan.tensor_parallel.axis=model"],
     "--config.mesh.axes"),
    ("no model", ["--config=mnist_dp", "--trainer_dir={tmp}/run", "--config.model=None"],
     "model: this experiment has no model"),
    ("ids past the vocabulary (vocab-parallel head: silent before)",
     ["--config=gpt_tiny_dp_tp", "--trainer_dir={tmp}/run", "--config.model.vocab_size=64"],
     "model.vocab_size"),
    ("sequences past the position table (NaN before)",
     ["--config=gpt_tiny_dp", "--trainer_dir={tmp}/run", "--config.model.max_seq_len=32"],
     "model.max_seq_len"),
    ("sequence parallelism with reduce-scatter forbidden",
     ["--config=gpt_tiny_dp_tp", "--config.plan.tensor_parallel.sequence_parallel=True",
      "--config.plan.tensor_parallel.prefer_reduce_scatter=False"],
     "plan.tensor_parallel.sequence_parallel"),
    ("TP on an adapted Flax module (no collectives)",
     ["--config=flax_nnx_gpt_dp", "--trainer_dir={tmp}/run", "--config.mesh.axes=('data','model')",
      "--config.mesh.shape=(4,2)", "--config.plan.tensor_parallel.axis=model"],
     "plan.tensor_parallel"),
    ("a logical axis rule no param uses",
     ["--config=flax_nnx_gpt_dp", "--trainer_dir={tmp}/run",
      "--config.plan.logical_axis_rules={{'embd': 'data'}}"],  # (braces: str.format below)
     "plan.logical_axis_rules['embd']"),
    ("training files that do not exist",
     ["--config=gpt_tiny_dp", "--trainer_dir={tmp}/run",
      "--config.train_input.source.files=['/nonexistent/*.txt']"], "train_input.source.files"),
    ("windows of zero tokens (a ZeroDivisionError traceback before)",
     ["--config=gpt_tiny_dp", "--trainer_dir={tmp}/run", "--config.train_input.source.seq_len=0"],
     "train_input.source.seq_len"),
    ("a held-out fraction above 1 (trained before)",
     ["--config=gpt_tiny_dp", "--trainer_dir={tmp}/run",
      "--config.evalers['heldout'].input.source.held_out_fraction=1.5"],
     "evalers['heldout'].input.source.held_out_fraction"),
    ("a model smaller than the bytes it reads (refused at the first rare byte before)",
     ["--config=llama_tiny_dp_tp", "--trainer_dir={tmp}/run", "--config.model.vocab_size=128"],
     "model.vocab_size"),
    ("a learning rate that is not a number",
     ["--config=gpt_tiny_dp", "--config.learner.optimizer.learning_rate.peak_value=nan"],
     "learner.optimizer.learning_rate.peak_value"),
    ("an lm-eval evaler's task folder that does not exist",
     ["--config=llama_tiny_sft", "--config.evalers={{}}",
      "--config.evalers['lm_eval'].tasks=['tiny_mc']",
      "--config.evalers['lm_eval'].include_path={tmp}/no_such_tasks"],
     "evalers['lm_eval'].include_path"),
    ("an lm-eval evaler's limit of 1.5 documents (ran 1 before)",
     ["--config=llama_tiny_sft", "--config.evalers={{}}",
      "--config.evalers['lm_eval'].tasks=['tiny_mc']", "--config.evalers['lm_eval'].limit=1.5"],
     "evalers['lm_eval'].limit"),
    ("a seed PRNGKey would wrap to 0", ["--config=gpt_tiny_dp", "--config.seed=4294967296"],
     "seed"),
    # Wave 5 moved every objective's fields under --config.objective.
    ("a preference field at its old path", ["--config=llama_tiny_dpo",
                                            "--config.preference.loss=ipo"],
     "--config.objective.loss"),
    ("KTO with a negative weight", ["--config=llama_tiny_kto",
                                    "--config.objective.undesirable_weight=-1"],
     "objective.undesirable_weight"),
    ("distillation with beta above 1", ["--config=llama_tiny_distill",
                                        "--config.objective.beta=1.5"], "objective.beta"),
    # Wave 5: nothing cut silently.
    ("chat prompts the window would cut at their start",
     ["--config=llama_tiny_grpo", "--trainer_dir={tmp}/run", "--config.train_input.source.chat=true",
      "--config.train_input.source.max_prompt_tokens=8"],
     "train_input.source.max_prompt_tokens"),
    ("SimPO with a negative target margin (trained before)",
     ["--config=llama_tiny_dpo", "--trainer_dir={tmp}/run", "--config.objective.loss=simpo",
      "--config.objective.simpo_gamma=-1", "--config.max_steps=1"], "objective.simpo_gamma"),
    ("every reward weighted 0 (trained on rewards of 0 before)",
     ["--config=llama_tiny_grpo", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.rewards['answer'].weight=0"],
     "objective.rewards['answer']"),
    ("a LoRA rank above every side of the weights (trained before)",
     ["--config=llama_tiny_lora_sft", "--trainer_dir={tmp}/run", "--config.lora.rank=512",
      "--config.max_steps=1"],
     "lora.rank"),
    ("a preference pair whose chosen is its rejected (trained before)",
     ["--config=llama_tiny_dpo", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.train_input.source.files=['{tmp}/pairs_same.jsonl']"], "pairs_same.jsonl:3"),
    ("pairs that differ only past the row (trained on equal rows before)",
     ["--config=llama_tiny_dpo", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.train_input.source.files=['{tmp}/pairs_long.jsonl']",
      "--config.train_input.source.seq_len=16"], "train_input.source.seq_len"),
    ("the Pallas GPU kernel on CPU devices (a jax traceback before)",
     ["--config=llama_tiny_dp_tp", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.model.attention_implementation=pallas"], "model.attention_implementation"),
    ("a reward function needing a field the prompts lack (a traceback at step 1 before)",
     ["--config=llama_tiny_grpo", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.rewards={{}}",
      "--config.objective.reward_functions=['tests.rl.user_rewards:needs_solution']"],
     "objective.reward_functions[0]: needs_solution needs the record field(s) solution"),
    # Agents: the environment and its tools, before step 1.
    ("an environment path that does not import",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.environment=no_such_package.Env"],
     "objective.environment: cannot import 'no_such_package'"),
    ("an environment class without step",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.environment=tests.agents.environments.NoStep"],
     "objective.environment: NoStep has no method step()"),
    ("max_turns 0", ["--config=llama_tiny_agent", "--config.objective.max_turns=0"],
     "objective.max_turns"),
    ("a tool without a docstring",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.tools=['tests.agents.tools.undocumented']"],
     "objective.tools[0]: tool 'undocumented' has no docstring"),
    ("a tool whose argument JSON cannot carry",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.tools=['tests.agents.tools.takes_a_point']"],
     "objective.tools[0]: tool 'takes_a_point' argument 'p'"),
    ("Muon on a param that is not a matrix",
     ["--config=llama_tiny_muon", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.learner.optimizer.matrices=['scale']"],
     "learner.optimizer.matrices: decoder/layer/input_norm/scale (shape (4, 128)) matches a "
     "Muon pattern but is not a matrix"),
    ("Muon on no param",
     ["--config=llama_tiny_muon", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.learner.optimizer.matrices=['nothing']"],
     "Muon would train nothing"),
    ("zero Newton-Schulz steps",
     ["--config=llama_tiny_muon", "--config.learner.optimizer.ns_steps=0"],
     "learner.optimizer.ns_steps: must be an int >= 1"),
    ("FP8 without bfloat16",
     ["--config=llama_tiny_dp_tp", "--config.precision.fp8=True"],
     "precision.fp8: float8 projections quantize bfloat16 activations"),
    ("FP8 with float64",
     ["--config=llama_tiny_dp_tp", "--config.precision.fp8=True",
      "--config.precision.float64=True"],
     "precision.fp8: float8 projections quantize bfloat16 activations"),
    ("FP8 on a Flax module (its products are its own: FP8 would change nothing)",
     ["--config=flax_nnx_gpt_dp", "--config.precision.bfloat16=True",
      "--config.precision.fp8=True", "--compile_only"],
     "precision.fp8: FP8 computes the model's projections in float8; FlaxNNX's layers compute "
     "their own products"),
    ("row-wise FP8 scales without FP8",
     ["--config=llama_tiny_dp_tp", "--config.precision.bfloat16=True",
      "--config.precision.fp8_rowwise=True"],
     "precision.fp8_rowwise: chooses how fp8 scales: set fp8=true as well"),
]

# What only a call can show (a run that starts, then meets it): the same exit status, message and
# no traceback -- the run's record is kept (it ran).
CALL_TIME_ERRORS = [
    ("a reward function that raises (named with the records it scored)",
     ["--config=llama_tiny_grpo", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.rewards={{}}",
      "--config.objective.reward_functions=['tests.rl.user_rewards:reads_difficulty']"],
     "reads_difficulty raised KeyError: 'difficulty' (scoring the completions of "),
    ("an environment's step returning two values (named with its record's file and line)",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.environment=tests.agents.environments.TwoValues"],
     "/calculator/prompts.jsonl:"),
    ("an environment's reward of NaN",
     ["--config=llama_tiny_agent", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.objective.environment=tests.agents.environments.NotANumber"],
     "sample 0) returned the reward nan"),
    # (Met when the step is traced: which experts path runs depends on the plan's binding.)
    ("FP8 with dropless experts and no expert axis (ragged_dot: FP8 does not compute it)",
     ["--config=gpt_oss_tiny", "--trainer_dir={tmp}/run", "--config.max_steps=1",
      "--config.plan.expert_parallel=None", "--config.mesh.axes=('data',)",
      "--config.mesh.shape=(None,)", "--config.precision.bfloat16=True",
      "--config.precision.fp8=True"],
     "precision.fp8: gpt_oss/decoder/layer/0/mlp: dropless experts without an expert axis "
     "multiply by ragged_dot"),
]


def _write_pairs(folder):
    """Preference pairs with a fault: pairs_same.jsonl (line 3 prefers nothing),
    pairs_long.jsonl (pairs that differ only after 40 shared answer bytes)."""
    good = [{"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1)}
            for a in range(40)]
    same = good[:2] + [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}] + good[2:]
    long = [{"prompt": f"{a}+{a}=", "chosen": "after a long and careful thought: yes",
             "rejected": "after a long and careful thought: no"} for a in range(40)]
    for name, records in (("pairs_same.jsonl", same), ("pairs_long.jsonl", long)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture(scope="module")
def bad_input_launches(tmp_path_factory):
    """Every BAD_INPUTS launch, run in one child process (tests/launch_cases.py: the launcher's
    parsing and main, its flags reset per case): case -> (its result, its directory)."""
    folders, cases = {}, []
    for case, args, _ in BAD_INPUTS + CALL_TIME_ERRORS:
        folder = tmp_path_factory.mktemp("bad_input")
        (folder / "a_file").write_text("not a directory")
        _write_pairs(folder)
        folders[case] = folder
        cases.append({"args": [a.format(tmp=folder, file=folder / "a_file") for a in args],
                      "cwd": REPO_ROOT})
    results = launch_in_one_child(cases, folder=str(tmp_path_factory.mktemp("cases")),
                                  env=ENV, timeout=900)
    return {case: (result, folders[case])
            for (case, _, _), result in zip(BAD_INPUTS + CALL_TIME_ERRORS, results)}


@pytest.mark.parametrize("case,path", [(c[0], c[2]) for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_exits_2_naming_the_path_without_a_traceback(bad_input_launches, case, path):
    result, folder = bad_input_launches[case]
    assert result["returncode"] == 2, (case, result["returncode"], result["stdout"][-2000:],
                                       result["stderr"][-2000:])
    assert path in result["stderr"], (case, result["stderr"])
    assert "Traceback" not in result["stderr"] + result["stdout"], case
    assert not os.path.exists(folder / "run" / "config.txt"), "a failed launch left a record"


@pytest.mark.parametrize("case,path", [(c[0], c[2]) for c in CALL_TIME_ERRORS],
                         ids=[c[0] for c in CALL_TIME_ERRORS])
def test_an_error_only_a_call_shows_exits_2_naming_it(bad_input_launches, case, path):
    result, _ = bad_input_launches[case]
    assert result["returncode"] == 2, (case, result["stdout"][-2000:], result["stderr"][-2000:])
    assert path in result["stderr"] and "Traceback" not in result["stderr"], result["stderr"]


def _quick_mnist(trainer_dir, *extra):
    return ["--config=mnist_dp", f"--trainer_dir={trainer_dir}", "--config.max_steps=5",
            "--config.evalers={}", "--config.log_every=1", *extra]


def _table(path):
    with open(path, encoding="utf-8") as f:
        return list(csv.reader(f))


def test_fresh_run_into_a_directory_with_checkpoints_is_refused(tmp_path):
    with_eval = ["--config=mnist_dp", f"--trainer_dir={tmp_path}", "--config.max_steps=5",
                 "--config.log_every=1"]  # The held-out evaluation runs after training.
    first = _launch(*with_eval)
    assert first.returncode == 0, first.stderr[-2000:]
    record, table = (tmp_path / "config.txt").read_text(), _table(tmp_path / "metrics.csv")
    again = _launch(*with_eval, "--config.checkpoint.resume=never", "--config.max_steps=10")
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert str(tmp_path / "checkpoints") in again.stderr
    assert "overwrite=true" in again.stderr and "--trainer_dir" in again.stderr
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["5"]
    # The refused launch left the run's record and metrics as they were.
    assert (tmp_path / "config.txt").read_text() == record
    assert not (tmp_path / "config.1.txt").exists()
    assert _table(tmp_path / "metrics.csv") == table
    # Launched again as it was: nothing to train, said with the ways forward; nothing rewritten.
    finished = _launch(*with_eval)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert "nothing to train" in finished.stdout and "--trainer_dir" in finished.stdout
    assert (tmp_path / "config.txt").read_text() == record
    rows = _table(tmp_path / "metrics.csv")
    assert len(rows) == len(set(map(tuple, rows)))  # No row twice, however often relaunched.


@pytest.mark.parametrize("command,misspelled,meant,badly_typed", [
    ("titanax.launch", "--cpu_device=8", "cpu_devices", "--cpu_devices=eight"),
    ("titanax.generate", "--max_new_token=8", "max_new_tokens", "--max_new_tokens=many"),
    ("titanax.evaluate", "--task=x", "tasks", "--batch_size=big"),
    ("titanax.export", "--tp=x", None, "--step=last"),
    ("titanax.data.pretokenize", "--seq_lenn=8", "seq_len", "--seq_len=long"),
    ("titanax.data.train_tokenizer", "--vocab_sise=300", "vocab_size", "--vocab_size=big"),
])
def test_every_command_exits_2_on_a_flag_mistake_and_0_on_help(command, misspelled, meant,
                                                               badly_typed):
    for args in ([misspelled], [badly_typed]):
        result = forked_python.run(["-m", command, *args], cwd=REPO_ROOT, env=ENV, timeout=120)
        assert result.returncode == 2, (command, args, result.stderr[-2000:])
        flag = args[0].split("=")[0]
        assert f"{command}: error: {flag}" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        if args == [misspelled] and meant:
            assert f"Did you mean: {meant}" in result.stderr, result.stderr
    helped = forked_python.run(["-m", command, "--help"], cwd=REPO_ROOT, env=ENV, timeout=120)
    assert helped.returncode == 0 and "--" in helped.stdout + helped.stderr


def test_flag_mistakes_exit_2_and_help_exits_0():
    wrong = _launch("--config=mnist_dp", "--cpu_device=8")
    assert wrong.returncode == 2 and "--cpu_device" in wrong.stderr
    assert "Did you mean: cpu_devices" in wrong.stderr and "Traceback" not in wrong.stderr
    assert _launch("--help").returncode == 0


def test_run_record_is_kept_numbered_and_written_only_for_real_runs(tmp_path):
    failed = _launch(*_quick_mnist(tmp_path, "--config.train_input.global_batch_size=12"))
    assert failed.returncode == 2 and "train_input.global_batch_size" in failed.stderr
    assert not (tmp_path / "config.txt").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for flag in ("--print_config", "--explain"):  # Neither writes a record unless asked to.
        shown = _launch("--config=mnist_dp", flag, cwd=elsewhere)
        assert shown.returncode == 0, shown.stderr[-2000:]
    assert not os.path.exists(elsewhere / "runs")
    first = _launch(*_quick_mnist(tmp_path))
    assert first.returncode == 0, first.stderr[-2000:]
    record = (tmp_path / "config.txt").read_text()
    assert "max_steps: 5" in record and oct((tmp_path / "config.txt").stat().st_mode)[-3:] == "644"
    resumed = _launch(*_quick_mnist(tmp_path, "--config.max_steps=8",
                                    "--config.learner.optimizer.learning_rate.peak_value=1e-3"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "differs from the one saved with step 5" in resumed.stdout
    assert "learner.optimizer.learning_rate.peak_value: 0.002 -> 0.001" in resumed.stdout
    assert "max_steps: 8" in (tmp_path / "config.txt").read_text()
    with open(tmp_path / "metrics.csv", encoding="utf-8") as f:  # One table, no repeated rows.
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert [int(r["step"]) for r in rows] == list(range(1, 9))
    assert (tmp_path / "config.1.txt").read_text() == record
    assert (tmp_path / "config_diff.1.txt").exists() and (tmp_path / "config.1.json").exists()


def test_documented_fp16_recipe_trains(tmp_path):
    result = _launch("--config=gpt_tiny_dp", f"--trainer_dir={tmp_path}", "--config.max_steps=6",
                     "--config.evalers={}", "--config.log_every=1", "--config.precision.fp16=true",
                     "--config.precision.loss_scaling=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "would recompile" not in result.stderr
    assert "step      6/6" in result.stdout
    assert " nan" not in result.stdout  # Not even the first step's time.


def _wait_for_signal_handlers(pid: int, timeout: float = 30.0) -> None:
    """Until the launcher caught SIGTERM (which Python alone never does): its first action.

    Before that instant the interpreter is still starting (tens of milliseconds), and a Ctrl-C
    there is Python's KeyboardInterrupt, not the launcher's to handle.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.005)
    raise AssertionError("the launcher never installed its signal handlers")


@pytest.mark.parametrize("delay", [0.0, 0.2, 1.0, 2.5])
def test_ctrl_c_in_the_first_seconds_exits_0_without_a_traceback(tmp_path, delay):
    process = subprocess.Popen([*LAUNCH, *_quick_mnist(tmp_path, "--config.max_steps=100000")],
                               cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE,
                               text=True)
    _wait_for_signal_handlers(process.pid)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, (delay, process.returncode, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr and "Fatal Python error" not in stderr
    assert "SIGINT received" in stdout


def test_sigterm_without_checkpoints_stops_the_run_and_says_nothing_was_saved(tmp_path):
    process = subprocess.Popen(
        [*LAUNCH, "--config=mnist_dp", f"--trainer_dir={tmp_path}", "--config.checkpoint=None",
         "--config.evalers={}", "--config.log_every=1", "--config.max_steps=100000"],
        cwd=REPO_ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    for line in process.stdout:  # Wait until training really runs.
        if line.startswith("step ") and "loss" in line:
            break
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, (stdout[-2000:], stderr[-2000:])
    assert "no checkpoint is configured, so nothing was saved" in stdout
    assert "Traceback" not in stderr
