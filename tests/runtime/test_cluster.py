"""Tests of process-layout resolution from flags and environment variables."""

import pytest

from titanax import errors
from titanax.runtime.cluster import resolve_cluster


def test_single_process_by_default():
    spec = resolve_cluster(environ={})
    assert (spec.num_processes, spec.process_id, spec.source) == (1, 0, "single-process")
    assert not spec.is_multi_process


def test_flags_win_over_environment():
    spec = resolve_cluster(coordinator_address="127.0.0.1:1234", num_processes=2, process_id=1,
                           environ={"TITANAX_NUM_PROCESSES": "4"})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == \
        ("127.0.0.1:1234", 2, 1, "flags")
    assert spec.is_multi_process


def test_titanax_environment_variables():
    spec = resolve_cluster(environ={"TITANAX_COORDINATOR_ADDRESS": "host:99",
                                    "TITANAX_NUM_PROCESSES": "3", "TITANAX_PROCESS_ID": "2"})
    assert (spec.num_processes, spec.process_id, spec.source) == (3, 2, "environment")


def test_slurm_is_left_to_jax_detection():
    spec = resolve_cluster(environ={"SLURM_NTASKS": "4", "SLURM_PROCID": "1"})
    assert spec.source == "slurm" and spec.is_multi_process


def test_jax_coordinator_address_comes_after_titanax_variables():
    full = resolve_cluster(environ={"JAX_COORDINATOR_ADDRESS": "h:9", "JAX_NUM_PROCESSES": "2",
                                    "JAX_PROCESS_ID": "1"})
    assert (full.coordinator_address, full.num_processes, full.process_id, full.source) == \
        ("h:9", 2, 1, "jax-environment") and full.is_multi_process
    partial = resolve_cluster(environ={"JAX_COORDINATOR_ADDRESS": "h:9"})
    assert partial.num_processes is None and partial.is_multi_process
    ours = resolve_cluster(environ={"JAX_COORDINATOR_ADDRESS": "h:9", "TITANAX_NUM_PROCESSES": "1"})
    assert ours.source == "environment" and not ours.is_multi_process


@pytest.mark.parametrize("environ,source", [
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_orte_hnp_uri": "x"}, "open-mpi"),
    ({"TPU_WORKER_HOSTNAMES": "a,b"}, "cloud-tpu"),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, "single-process"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, "single-process"),  # Any pod has it.
])
def test_clusters_jax_detects(environ, source):
    spec = resolve_cluster(environ=environ)
    assert spec.source == source and spec.is_multi_process == (source != "single-process")
    assert spec.describe()


def test_one_process_needs_no_coordinator():
    assert resolve_cluster(num_processes=1, environ={}).num_processes == 1


@pytest.mark.parametrize("kwargs,path", [
    (dict(num_processes=2, process_id=0), "--coordinator_address"),
    (dict(coordinator_address="a:1", num_processes=2), "--process_id"),
    (dict(coordinator_address="a:1", num_processes=2, process_id=-1), "--process_id"),
    (dict(coordinator_address="a:70000", num_processes=2, process_id=0), "--coordinator_address"),
    (dict(coordinator_address="a:1", num_processes=0, process_id=0), "--num_processes"),
])
def test_bad_flags_name_the_flag(kwargs, path):
    with pytest.raises(errors.LaunchFlagError) as info:
        resolve_cluster(environ={}, **kwargs)
    assert info.value.path == path


def test_bad_environment_value_names_the_variable():
    with pytest.raises(errors.LaunchFlagError) as info:
        resolve_cluster(environ={"TITANAX_COORDINATOR_ADDRESS": "h:1",
                                 "TITANAX_NUM_PROCESSES": "two", "TITANAX_PROCESS_ID": "0"})
    assert info.value.path == "TITANAX_NUM_PROCESSES"
