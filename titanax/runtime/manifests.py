"""Cluster manifests: ``--emit=slurm`` (an sbatch script) and ``--emit=jobset`` (a Kubernetes
JobSet) for a run, printed instead of running it.

Both start one process per node (host) with ``devices_per_node`` accelerators, every process
running the same ``python -m titanax.launch`` command. The job's shape reaches each process as
Titanax's own variables (``TITANAX_COORDINATOR_ADDRESS`` / ``_NUM_PROCESSES`` / ``_PROCESS_ID``,
runtime/cluster.py), written out rather than left to jax's cluster detectors: the manifest says
what every process will be, and the same variables work on a site whose scheduler jax does not
know. Process 0's host runs jax's coordination service on ``COORDINATOR_PORT``.

The run's own guarantees need two things of the site, which the manifests ask for and
docs/clusters.md explains: SIGTERM ahead of the end (SLURM's ``--signal``, Kubernetes' grace
period: Titanax saves on SIGTERM) and a ``--trainer_dir`` every node sees (a shared file
system or a mounted bucket): a restarted job resumes from it.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from typing import Dict, List, Tuple

from titanax import errors

# The manifests --emit writes.
TARGETS = ("slurm", "jobset")
# Accelerators per node when not given (an 8-GPU host).
DEFAULT_GPUS_PER_NODE = 8
# The container image when not given: an image built from this checkout (docs/clusters.md).
DEFAULT_IMAGE = "titanax:latest"
# Port of jax's coordination service on process 0's host.
COORDINATOR_PORT = 1234
# Seconds between SIGTERM and the end (SLURM's time limit, Kubernetes' kill): the run saves
# its checkpoint in them.
SAVE_SECONDS = 300
# Restarts of the whole JobSet after a failure (each resumes from the newest checkpoint).
JOBSET_MAX_RESTARTS = 3
# Kubernetes names: the JobSet's name also starts every pod's host name (<= 63 characters).
_NAME_LENGTH = 40


@dataclasses.dataclass(frozen=True)
class ClusterRun:
    """What a manifest starts."""

    # The experiment's name (the job's name comes from it).
    experiment: str
    # The arguments after ``python -m titanax.launch``, the same on every node.
    args: Tuple[str, ...]
    # Nodes (hosts), one process each.
    nodes: int
    # Accelerators per node.
    devices_per_node: int
    # Request GPUs (False: CPU nodes, the command simulating ``devices_per_node`` devices).
    gpus: bool
    # The container image (JobSet); it must hold Titanax.
    image: str

    @property
    def command(self) -> List[str]:
        return ["python", "-m", "titanax.launch", *self.args]

    @property
    def shape(self) -> str:
        kind = "GPU" if self.gpus else "simulated CPU device"
        return (f"{self.nodes} node{'s' if self.nodes != 1 else ''} x {self.devices_per_node} "
                f"{kind}{'s' if self.devices_per_node != 1 else ''}, one process per node")


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise errors.LaunchFlagError(f"unknown target {target!r}", path="--emit",
                                     suggestion=f"one of {', '.join(TARGETS)}")


def check_count(value: int, *, flag: str) -> None:
    if value < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {value}", path=flag,
                                     suggestion="count whole nodes / devices")


def emit(target: str, run: ClusterRun) -> str:
    """The manifest's text."""
    check_target(target)
    return {"slurm": slurm_script, "jobset": jobset_manifest}[target](run)


def slurm_script(run: ClusterRun) -> str:
    """An sbatch script: one task per node; process 0 is the first node of the allocation."""
    command = " \\\n      ".join(["python -m titanax.launch"] + [shlex.quote(a) for a in run.args])
    lines = [
        "#!/bin/bash",
        f"# Titanax run {run.experiment}: {run.shape}.",
        "# Submit with `sbatch <this file>`; see docs/clusters.md.",
        f"#SBATCH --job-name={_job_name(run.experiment)}",
        f"#SBATCH --nodes={run.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={run.devices_per_node}"] if run.gpus else []),
        "#SBATCH --exclusive",
        "#SBATCH --output=%x-%j.out",
        f"# SIGTERM {SAVE_SECONDS} s before the time limit: the run saves and stops.",
        f"#SBATCH --signal=TERM@{SAVE_SECONDS}",
        "set -euo pipefail",
        "# Process 0's host runs jax's coordination service.",
        'TITANAX_COORDINATOR_ADDRESS="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | '
        f'head -n 1):{COORDINATOR_PORT}"',
        f"export TITANAX_COORDINATOR_ADDRESS TITANAX_NUM_PROCESSES={run.nodes}",
        "# Each task's index in the job is its process id.",
        f"srun --nodes={run.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  bash -c 'TITANAX_PROCESS_ID=\"$SLURM_PROCID\" exec \"$@\"' titanax \\",
        f"    {command}",
    ]
    return "\n".join(lines) + "\n"


def jobset_manifest(run: ClusterRun) -> str:
    """A JobSet (jobset.x-k8s.io) of one indexed Job: pod i is process i; pod 0's stable host
    name (the JobSet's headless service) is the coordinator's address."""
    import yaml  # pylint: disable=import-outside-toplevel
    name = _job_name(run.experiment)
    container: Dict = {
        "name": "titanax",
        "image": run.image,
        "command": run.command,
        "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}],
        "env": [
            {"name": "TITANAX_COORDINATOR_ADDRESS",
             "value": f"{name}-workers-0-0.{name}:{COORDINATOR_PORT}"},
            {"name": "TITANAX_NUM_PROCESSES", "value": str(run.nodes)},
            {"name": "TITANAX_PROCESS_ID", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}},
        ],
    }
    if run.gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": run.devices_per_node}}
    manifest = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": {"maxRestarts": JOBSET_MAX_RESTARTS},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{
                "name": "workers",
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": run.nodes,
                    "completions": run.nodes,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    "template": {"spec": {
                        "restartPolicy": "Never",
                        "terminationGracePeriodSeconds": SAVE_SECONDS,
                        "containers": [container],
                    }},
                }},
            }],
        },
    }
    header = [f"# Titanax run {run.experiment}: {run.shape}.",
              "# Apply with `kubectl apply -f <this file>` (JobSet's controller installed). The "
              "image must hold",
              "# Titanax and --trainer_dir be a volume every pod mounts (docs/clusters.md). A "
              "failed job",
              f"# restarts up to {JOBSET_MAX_RESTARTS} times, each resuming from the newest "
              "checkpoint."]
    return "\n".join(header) + "\n" + yaml.safe_dump(manifest, sort_keys=False,
                                                     default_flow_style=False, width=100)


def _job_name(experiment: str) -> str:
    """A DNS-1035 label: lower case letters, digits and '-', starting with a letter."""
    name = re.sub(r"[^a-z0-9-]+", "-", experiment.lower()).strip("-")
    name = name if name[:1].isalpha() else f"titanax-{name}"
    return name[:_NAME_LENGTH].rstrip("-") or "titanax"

