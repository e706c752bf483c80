"""``--emit=slurm|jobset``: the manifests as written (golden files), and each one's job run on
this machine -- the sbatch script by bash with a one-machine ``srun`` / ``scontrol`` on PATH,
the JobSet's pods as local processes with the env the manifest gives them -- training the
same steps.

Goldens: ``TITANAX_UPDATE_GOLDENS=1 pytest tests/runtime/test_manifests.py`` rewrites them.
"""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest
import yaml

from titanax.runtime import local_processes, manifests
from titanax.utils import command_args

from tests.environment import child_environment
from tests.launch_cases import launch_in_one_child
from tests.run_outputs import metric_rows

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "manifests")
# golden file -> the launcher's arguments
GOLDEN = {
    "llama_tiny_dp_tp.slurm.sh": ["--config=llama_tiny_dp_tp", "--emit=slurm", "--nodes=2"],
    "llama_tiny_dp_tp.jobset.yaml": ["--config=llama_tiny_dp_tp", "--emit=jobset", "--nodes=4",
                                     "--devices_per_node=4", "--image=registry.example/t:1",
                                     "--trainer_dir=/mnt/runs/llama",
                                     "--config.learner.optimizer.learning_rate.peak_value=1e-3"],
}
STEPS = 2
# A job of two CPU nodes simulating 4 devices each (the mesh data x model = 4 x 2).
RUN = ["--config=llama_tiny_dp_tp", "--nodes=2", "--cpu_devices=4",
       f"--config.max_steps={STEPS}", "--config.log_every=1", "--config.evalers={}"]
# srun and scontrol of a one-machine "cluster": every task a local process, SLURM_PROCID its
# index; every node this machine.
SRUN = """#!/bin/bash
nodes=1
while [[ $1 == --* ]]; do
  case $1 in --nodes=*) nodes=${1#--nodes=};; esac
  shift
done
pids=()
for ((i = 0; i < nodes; i++)); do SLURM_PROCID=$i SLURM_NTASKS=$nodes "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = "#!/bin/bash\necho 127.0.0.1\n"


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """Every manifest of this file, written by the launcher (one child process)."""
    root = tmp_path_factory.mktemp("emitted")
    cases = [{"args": args, "cwd": REPO_ROOT} for args in GOLDEN.values()]
    runs = {target: os.path.join(str(root), target) for target in manifests.TARGETS}
    cases += [{"args": [*RUN, f"--emit={target}", f"--trainer_dir={runs[target]}"],
               "cwd": REPO_ROOT} for target in manifests.TARGETS]
    results = launch_in_one_child(cases, folder=str(root),
                                  env=child_environment(keep_device_count=True))
    for case, result in zip(cases, results):
        assert result["returncode"] == 0, (case["args"], result["stderr"][-3000:])
    texts = [result["stdout"] for result in results]
    return (dict(zip(GOLDEN, texts)),
            {target: (texts[len(GOLDEN) + i], runs[target])
             for i, target in enumerate(manifests.TARGETS)})


def test_the_manifests_are_the_golden_ones(emitted):
    for name, text in emitted[0].items():
        path = os.path.join(GOLDEN_DIR, name)
        if os.environ.get("TITANAX_UPDATE_GOLDENS"):
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        with open(path, encoding="utf-8") as f:
            assert text == f.read(), f"{name} changed: TITANAX_UPDATE_GOLDENS=1 rewrites it"
    slurm = emitted[0]["llama_tiny_dp_tp.slurm.sh"]
    assert subprocess.run(["bash", "-n"], input=slurm, text=True, check=False).returncode == 0
    jobset = yaml.safe_load(emitted[0]["llama_tiny_dp_tp.jobset.yaml"])
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    assert (job["parallelism"], job["completions"]) == (4, 4)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert container["image"] == "registry.example/t:1"
    # The command is the launch's, less the manifest's own flags, the overrides kept as given.
    assert container["command"] == [
        "python", "-m", "titanax.launch", "--config=llama_tiny_dp_tp",
        "--trainer_dir=/mnt/runs/llama",
        "--config.learner.optimizer.learning_rate.peak_value=1e-3"]


def _losses(trainer_dir):
    rows = metric_rows(trainer_dir)
    return np.array([float(rows[step]["loss"]) for step in range(1, STEPS + 1)])


def _executable(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR)


def test_each_manifests_job_trains_on_this_machine(emitted, tmp_path):
    (slurm, slurm_dir), (jobset, jobset_dir) = (emitted[1][t] for t in manifests.TARGETS)
    port = str(local_processes.free_port())
    env = child_environment(PYTHONPATH=REPO_ROOT)
    env.pop("TITANAX_PROCESS_ID", None)
    # SLURM: the script itself, by bash, this machine its allocation.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "srun", SRUN)
    _executable(bin_dir / "scontrol", SCONTROL)
    _executable(bin_dir / "python", f'#!/bin/bash\nexec {sys.executable} "$@"\n')
    script = tmp_path / "job.sh"
    script.write_text(slurm.replace(f":{manifests.COORDINATOR_PORT}", f":{port}"))
    slurm_run = subprocess.Popen(
        ["bash", str(script)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**env, "PATH": f"{bin_dir}:{env['PATH']}",
                        "SLURM_JOB_NODELIST": "node[0-1]"})
    slurm_out = slurm_run.communicate(timeout=600)[0]
    assert slurm_run.returncode == 0, slurm_out[-3000:]
    # JobSet: pod i runs the container's command with its env, the index its process id and
    # the coordinator's host name this machine.
    container = yaml.safe_load(jobset)["spec"]["replicatedJobs"][0]["template"]["spec"][
        "template"]["spec"]["containers"][0]
    given = {e["name"]: e.get("value") for e in container["env"]}
    host = given["TITANAX_COORDINATOR_ADDRESS"].rsplit(":", 1)[0]
    assert host.endswith(f"-workers-0-0.{yaml.safe_load(jobset)['metadata']['name']}")
    pods = [subprocess.Popen(
        [sys.executable, *container["command"][1:]], cwd=REPO_ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env={**env, "TITANAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
             "TITANAX_NUM_PROCESSES": given["TITANAX_NUM_PROCESSES"],
             "TITANAX_PROCESS_ID": str(index)})
        for index in range(int(given["TITANAX_NUM_PROCESSES"]))]
    outputs = [pod.communicate(timeout=600)[0] for pod in pods]
    for pod, output in zip(pods, outputs):
        assert pod.returncode == 0, output[-3000:]
    for out in (slurm_out, outputs[0]):
        assert f"trained to step {STEPS} of {STEPS}" in out, out[-3000:]
    for index in range(2):  # (Each process of each job on stderr, the job's shape from env.)
        line = f"titanax process {index}/2: 4 local / 8 global cpu device(s) [environment]"
        assert line in slurm_out and line in outputs[index], slurm_out[-3000:]
    np.testing.assert_array_equal(_losses(slurm_dir), _losses(jobset_dir))


def test_a_launchers_own_flags_are_not_handed_on():
    args = ["--config=x", "--emit", "slurm", "--nodes=2", "-image", "i", "--config.a=1",
            "--explain"]
    assert command_args.without_flags(args, ("emit", "nodes", "image")) == [
        "--config=x", "--config.a=1", "--explain"]


def test_job_names_are_kubernetes_labels():
    # pylint: disable=protected-access
    assert manifests._job_name("llama_tiny_dp_tp") == "llama-tiny-dp-tp"
    assert manifests._job_name("3b_Run.v2") == "titanax-3b-run-v2"
    assert len(manifests._job_name("x" * 90)) == 40
