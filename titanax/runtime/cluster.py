"""Who is in the job: the coordinator address, the number of processes and this process's id.

Resolved from (in order) explicit launcher flags, ``TITANAX_COORDINATOR_ADDRESS`` /
``TITANAX_NUM_PROCESSES`` / ``TITANAX_PROCESS_ID``, jax's ``JAX_COORDINATOR_ADDRESS`` (with
``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or the rest auto-detected), a cluster jax detects itself
(a SLURM allocation, an Open MPI job, a Kubernetes indexed Job, a multi-host Cloud TPU), or else a
single process. Everything here is checked before jax starts, so a typo in a launch script fails
at once instead of hanging at the rendezvous. This module does not import jax.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Mapping, Optional

from titanax import errors

ENV_COORDINATOR = "TITANAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "TITANAX_NUM_PROCESSES"
ENV_PROCESS_ID = "TITANAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The resolved shape of the job."""

    # host:port of process 0's coordination service; None for one process or auto-detection.
    coordinator_address: Optional[str]
    # Number of processes in the job (>= 1); None when left to jax's cluster auto-detection.
    num_processes: Optional[int]
    # This process's index in [0, num_processes); None when auto-detected.
    process_id: Optional[int]
    # Where the values came from: "flags", "environment" (TITANAX_*), "jax-environment"
    # (JAX_COORDINATOR_ADDRESS), one of AUTO_DETECTED (left to jax's detectors) or
    # "single-process".
    source: str

    @property
    def is_multi_process(self) -> bool:
        if self.num_processes is None:
            return self.source in AUTO_DETECTED
        return self.num_processes > 1

    def describe(self) -> str:
        """One line for the logs: who is in the job and where that came from."""
        if self.source == "single-process":
            return "one process (no cluster found)"
        count = self.num_processes if self.num_processes is not None else "?"
        index = self.process_id if self.process_id is not None else "?"
        where = self.coordinator_address or "auto-detected coordinator"
        return f"process {index} of {count}, coordinator {where} (from {self.source})"


# Clusters whose layout is left to jax's own detection (jax/_src/clusters).
AUTO_DETECTED = ("slurm", "open-mpi", "kubernetes", "cloud-tpu", "jax-environment")


def _detected_cluster(environ: Mapping[str, str]) -> Optional[str]:
    """The cluster jax would detect here, judged from its environment variables only."""
    def count(name: str) -> int:
        try:
            return int(environ.get(name, "1") or 1)
        except ValueError:
            return 1
    if count("SLURM_NTASKS") > 1 and "SLURM_PROCID" in environ:
        return "slurm"
    if count("OMPI_COMM_WORLD_SIZE") > 1 and "OMPI_MCA_orte_hnp_uri" in environ:
        return "open-mpi"
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ \
            and importlib.util.find_spec("kubernetes") is not None:
        return "kubernetes"
    if len([h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "cloud-tpu"
    return None


def resolve_cluster(*, coordinator_address: Optional[str] = None,
                    num_processes: Optional[int] = None, process_id: Optional[int] = None,
                    environ: Optional[Mapping[str, str]] = None) -> ClusterSpec:
    """Resolves and checks the job's process layout (see the module docstring for the order)."""
    environ = os.environ if environ is None else environ
    given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
             "--process_id": process_id}
    if any(v is not None for v in given.values()):
        return _checked(coordinator_address, num_processes, process_id, source="flags",
                        names=("--coordinator_address", "--num_processes", "--process_id"))
    env_values = [environ.get(k) for k in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)]
    if any(v is not None for v in env_values):
        names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        return _checked(env_values[0], _env_int(env_values[1], names[1]),
                        _env_int(env_values[2], names[2]), source="environment", names=names)
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
        count = _env_int(environ.get(names[1]), names[1])
        index = _env_int(environ.get(names[2]), names[2])
        if count is not None and index is not None:
            return _checked(environ[names[0]], count, index, source="jax-environment",
                            names=names)
        return ClusterSpec(coordinator_address=environ[names[0]], num_processes=count,
                           process_id=index, source="jax-environment")
    detected = _detected_cluster(environ)
    if detected is not None:
        return ClusterSpec(coordinator_address=None, num_processes=None, process_id=None,
                           source=detected)
    return ClusterSpec(coordinator_address=None, num_processes=1, process_id=0,
                       source="single-process")


def _env_int(text: Optional[str], name: str) -> Optional[int]:
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise errors.LaunchFlagError(f"must be an int, got {text!r}", path=name) from None


def _checked(address, num_processes, process_id, *, source, names) -> ClusterSpec:
    address_name, count_name, id_name = names
    missing = [name for name, value in zip(names, (address, num_processes, process_id))
               if value is None]
    if num_processes == 1 and process_id in (None, 0) and address is None:
        return ClusterSpec(coordinator_address=None, num_processes=1, process_id=0, source=source)
    if missing:
        raise errors.LaunchFlagError(
            f"a multi-process job needs all of {', '.join(names)}; missing {', '.join(missing)}",
            path=missing[0], suggestion=f"e.g. {address_name}=10.0.0.1:1234 {count_name}=2 "
                                        f"{id_name}=0 (process ids run from 0 to N-1)")
    if num_processes < 1:
        raise errors.LaunchFlagError(f"must be >= 1, got {num_processes}", path=count_name)
    if not 0 <= process_id < num_processes:
        raise errors.LaunchFlagError(
            f"must be in [0, {num_processes}) for {num_processes} processes, got {process_id}",
            path=id_name, suggestion="number processes 0, 1, ..., N-1")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise errors.LaunchFlagError(f"must be host:port, got {address!r}", path=address_name,
                                     suggestion="e.g. 127.0.0.1:12345 (process 0's address)")
    return ClusterSpec(coordinator_address=address, num_processes=num_processes,
                       process_id=process_id, source=source)
