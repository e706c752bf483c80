"""``python -m titanax.launch``: run a named experiment, with overrides from the command line.

    python -m titanax.launch --list
    python -m titanax.launch --config=gpt_tiny_dp_tp --cpu_devices=8
    python -m titanax.launch --config=gpt_tiny_dp_tp --config.learner.optimizer.learning_rate=1e-3
    python -m titanax.launch --config=gpt_tiny_dp --config.plan.zero.stage=1 --print_config
    python -m titanax.launch --config=gpt_tiny_dp_tp --local_processes=2 --cpu_devices=4
    python -m titanax.launch --config=gpt_tiny_dp --config_file=run.yaml
    python -m titanax.launch --module=my_script:main --config=gpt_tiny_dp --local_processes=2 --cpu_devices=4
    python -m titanax.launch --config=gpt_small_dp_tp --emit=slurm --nodes=4 > job.sh

Order of events, and why: flags are parsed and checked, the experiment's config tree is built,
overrides are applied (a --config_file first, then the --config.* flags) and the whole tree is
validated -- all before jax starts, so every mistake costs a second, not a compile. Only then is
the device count fixed, the process joins its job (several processes: --local_processes spawns
them here; on a cluster each is started by the scheduler and finds the others, see
runtime/cluster.py), and the experiment runs -- or, with --module, the user's ``main(config)``.
Only process 0 prints to stdout; every process prints warnings and errors to stderr.

A ``TitanaxError`` prints as a short message (path, problem, suggestion) and exits with status 2;
``--show_traceback`` shows the Python traceback too.
"""

from __future__ import annotations

# pylint: disable=wrong-import-position
# First of all: Ctrl-C / SIGTERM in the first seconds become a request honoured at the next safe
# point, never a KeyboardInterrupt unwinding through jax's start-up (see train/preemption.py).
# Only when this module is the program (python -m / the titanax-launch script), not on import.
import sys

from titanax.train import preemption

if __name__ == "__main__" or sys.argv and sys.argv[0].endswith("titanax-launch"):
    preemption.install_early()

import atexit
import importlib
import inspect
import json
import os
import signal
import tempfile
from typing import Any, Dict, List, Sequence

from absl import app, flags

from titanax import command_line, errors
from titanax.config import overrides as overrides_lib
from titanax.config import registry
from titanax.config import config_file
from titanax.observe import console, goodput
from titanax.runtime import cluster, cpu_devices, distributed, garbage_collection, local_processes
from titanax.runtime import manifests
from titanax.utils import command_args
from titanax.utils.files import atomic_write_text

_CONFIG = flags.DEFINE_string("config", None, "Name of a registered experiment (see --list).")
_LIST = flags.DEFINE_bool("list", False, "List the registered experiments and exit.")
_CONFIG_MODULE = flags.DEFINE_multi_string(
    "config_module", [], "Extra modules (or packages) that register experiments, in addition to "
    "the built-in ones (package titanax_experiments); the current folder is searched. "
    "Repeatable.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config and its diff from the named experiment, "
    "then exit without running.")
_TRAINER_DIR = flags.DEFINE_string(
    "trainer_dir", None, "Run directory: the resolved config is saved here (config.txt, "
    "config.json, config_diff.txt; earlier records are kept numbered) when the run starts, and "
    "so are logs and checkpoints. Default: runs/<config>.")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None, "Simulate this many CPU devices (set before jax starts).")
_COORDINATOR_ADDRESS = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process jobs.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index, 0..N-1.")
_LOCAL_PROCESSES = flags.DEFINE_integer(
    "local_processes", None, "Run the job as this many processes on this machine (loopback): "
    "each gets --cpu_devices simulated CPU devices, or a slice of the visible GPUs; output "
    "lines are prefixed with the process index; the first failure stops the job.")
_CONFIG_FILE = flags.DEFINE_string(
    "config_file", None, "A YAML or JSON file of `path: value` overrides (nested or dotted), "
    "applied like --config.<path>=<value> before the command line's.")
_MODULE = flags.DEFINE_string(
    "module", None, "Run your own `module:function` in every process instead of the "
    "experiment's run(): it is called with the resolved config (None without --config), after "
    "the process joined the job, and with trainer_dir= when it takes that argument.")
_EXPLAIN = flags.DEFINE_bool(
    "explain", False, "Build the run, compile its train step on the first batch, print the mesh, "
    "every param's layout and the compiled step's collectives, then exit.")
_COMPILE_ONLY = flags.DEFINE_bool(
    "compile_only", False, "Build the run from shapes alone (no param, optimizer state or batch "
    "allocated, no data read, nothing written), compile its train step for the configured mesh, "
    "print the memory per device -- last line one JSON object of byte counts -- and exit.")
_SHOW_TRACEBACK = flags.DEFINE_bool(
    "show_traceback", False, "Show the Python traceback of Titanax errors.")
_EMIT = flags.DEFINE_string(
    "emit", None, "Print a cluster manifest for this run instead of running it, then exit: "
    "`slurm` (an sbatch script) or `jobset` (a Kubernetes JobSet); one process per node, each "
    "running this command. See docs/clusters.md.")
_NODES = flags.DEFINE_integer("nodes", None, "--emit: nodes (hosts) of the job (default 1).")
_DEVICES_PER_NODE = flags.DEFINE_integer(
    "devices_per_node", None, "--emit: GPUs per node (default 8; with --cpu_devices=K: CPU "
    "nodes simulating K devices each).")
_IMAGE = flags.DEFINE_string(
    "image", None, f"--emit=jobset: the container image, which must hold Titanax "
    f"(default {manifests.DEFAULT_IMAGE}).")

# The --config.<path>=<value> arguments, split off before absl parses the rest.
_OVERRIDES: List[overrides_lib.Override] = []
# The command line's arguments as given (handed on to the processes of a local job and to
# the command of a manifest).
_ARGS: List[str] = []


def _parse_flags(argv: Sequence[str]) -> List[str]:
    """The --config.<path>=<value> overrides split off, then absl's parsing with Titanax's
    conventions (``command_line.parse_flags``: a flag mistake exits 2, help exits 0)."""
    rest, found = overrides_lib.split_override_args(list(argv))
    _OVERRIDES[:] = found
    _ARGS[:] = argv[1:]
    return command_line.parse_flags(rest, name="titanax.launch")


def _format_experiment_list() -> str:
    experiments = registry.experiments()
    if not experiments:
        return "no experiments are registered"
    width = max(len(e.name) for e in experiments)
    lines = [f"{e.name:<{width}}  {e.summary}" if e.summary else e.name for e in experiments]
    return "\n".join(lines)


# The run record: file name -> what it holds.
_RECORD_FILES = ("config.txt", "config.json", "config_diff.txt")
# Simulating more CPU devices than this takes minutes to start, or never finishes.
_MAX_CPU_DEVICES = 4096


def save_run_record(trainer_dir: str, cfg, diff: List[str]) -> None:
    """Writes the resolved config (config.txt, config.json, config_diff.txt) into the run dir.

    Called only once the config validated and the run is really starting. An earlier record
    that differs is kept, numbered (config.1.txt, config.1.json, config_diff.1.txt, then 2...);
    a launch with an identical config adds nothing.
    """
    texts: Dict[str, str] = {
        "config.txt": cfg.debug_string(),
        "config.json": json.dumps(cfg.to_json(), indent=2, sort_keys=False) + "\n",
        "config_diff.txt": "".join(line + "\n" for line in diff)}
    current = os.path.join(trainer_dir, "config.txt")
    if os.path.exists(current):
        with open(current, encoding="utf-8") as f:
            if f.read() == texts["config.txt"]:
                return
        number = 1
        while any(os.path.exists(os.path.join(trainer_dir, _numbered(name, number)))
                  for name in _RECORD_FILES):
            number += 1
        for name in _RECORD_FILES:
            if os.path.exists(os.path.join(trainer_dir, name)):
                os.replace(os.path.join(trainer_dir, name),
                           os.path.join(trainer_dir, _numbered(name, number)))
    for name, text in texts.items():
        atomic_write_text(os.path.join(trainer_dir, name), text)


def _numbered(name: str, number: int) -> str:
    root, ext = os.path.splitext(name)
    return f"{root}.{number}{ext}"


# Run directories this process made (check_trainer_dir): a run refused before it wrote anything
# leaves none of them behind (main()).
_MADE_TRAINER_DIRS: List[str] = []


def _remove_made_dirs_left_empty() -> None:
    for path in _MADE_TRAINER_DIRS:
        try:
            os.rmdir(path)  # (Only if still empty: whatever a run wrote stays.)
        except OSError:
            pass


def check_trainer_dir(path: str) -> str:
    """Makes sure the run directory exists (or can be made) and is writable; returns it."""
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        raise errors.LaunchFlagError(
            f"{full} is a file, not a directory", path="--trainer_dir",
            suggestion="name a directory (new or existing) for the run's checkpoints and logs")
    ancestor, made = full, []  # (made: the levels makedirs creates, innermost first.)
    while not os.path.exists(ancestor):
        made.append(ancestor)
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise errors.LaunchFlagError(
            f"cannot make {full}: {ancestor} is a file", path="--trainer_dir",
            suggestion="choose a path whose parents are directories")
    try:
        os.makedirs(full, exist_ok=True)
        _MADE_TRAINER_DIRS.extend(made)
        with tempfile.TemporaryFile(dir=full):
            pass
    except OSError as e:
        raise errors.LaunchFlagError(
            f"cannot write into {full}: {e.strerror or e}", path="--trainer_dir",
            suggestion="choose a directory you can write to (check its permissions and "
                       "free space)") from e
    return path


def launch(argv: Sequence[str]) -> int:
    """The launcher's body, after absl parsed the flags. Returns the exit status."""
    if len(argv) > 1:
        raise errors.LaunchFlagError(f"unexpected positional arguments: {' '.join(argv[1:])}",
                                     path="argv", suggestion="all settings are --flags; "
                                     "overrides are --config.<path>=<value>")
    cluster_spec = cluster.resolve_cluster(coordinator_address=_COORDINATOR_ADDRESS.value,
                                           num_processes=_NUM_PROCESSES.value,
                                           process_id=_PROCESS_ID.value)
    spawn = _check_local_processes(cluster_spec)
    _check_emit_flags(cluster_spec)
    _simulate_cpu_devices()
    registry.load_config_modules(list(registry.DEFAULT_CONFIG_MODULES) + _CONFIG_MODULE.value)
    if _LIST.value:
        print(_format_experiment_list())
        return 0
    if not _CONFIG.value and not _MODULE.value:
        raise errors.LaunchFlagError(
            "no experiment given", path="--config",
            suggestion="pass --config=NAME; `python -m titanax.launch --list` shows the names")
    if _MODULE.value:
        _check_entry_point_text()
    if not _CONFIG.value and (_CONFIG_FILE.value or _OVERRIDES):
        raise errors.LaunchFlagError(
            "config overrides without an experiment to apply them to", path="--config",
            suggestion="name the experiment with --config=NAME (see --list)")
    cfg, diff = _resolved_config() if _CONFIG.value else (None, [])
    trainer_dir = _TRAINER_DIR.value or os.path.join("runs", _CONFIG.value or "user_module")
    if _EMIT.value is not None:
        return _emit_manifest(cfg, trainer_dir=trainer_dir)
    # The run record is written only for a run that really starts (or where asked for).
    record = cfg is not None and not _COMPILE_ONLY.value and (
        _TRAINER_DIR.value is not None or not (_PRINT_CONFIG.value or _EXPLAIN.value))
    if record:
        check_trainer_dir(trainer_dir)
    if _PRINT_CONFIG.value:
        return _print_config(cfg, diff, trainer_dir=trainer_dir, record=record)
    if spawn:
        return _run_local_job()
    if not cluster_spec.is_multi_process:  # (In a job the request is agreed on after joining.)
        preemption.exit_if_requested("while the config was built")
    _join_job(cluster_spec, quiet=not _MODULE.value)
    if _MODULE.value:  # Imported only now: its import may touch devices.
        entry = _user_entry_point()
        takes_dir = "trainer_dir" in inspect.signature(entry).parameters
        result = entry(cfg, trainer_dir=trainer_dir) if takes_dir else entry(cfg)
        return result if isinstance(result, int) else 0
    return _run_experiment(cfg, diff, trainer_dir=trainer_dir, record=record,
                           cluster_spec=cluster_spec)


def _simulate_cpu_devices() -> None:
    """``--cpu_devices``: that many simulated CPU devices (before jax starts)."""
    if _CPU_DEVICES.value is None:
        return
    if _CPU_DEVICES.value > _MAX_CPU_DEVICES:
        raise errors.LaunchFlagError(
            f"{_CPU_DEVICES.value} simulated CPU devices is more than Titanax supports "
            f"({_MAX_CPU_DEVICES}): jax would take minutes to start them, or never finish",
            path="--cpu_devices", suggestion="simulate the mesh you mean to test, e.g. "
            "--cpu_devices=8; the real device count comes from the accelerators")
    cpu_devices.simulate_cpu_devices(_CPU_DEVICES.value)


def _print_config(cfg: Any, diff: Sequence[str], *, trainer_dir: str, record: bool) -> int:
    """``--print_config``: the resolved config and its diff from the experiment."""
    if cfg is None:
        raise errors.LaunchFlagError("nothing to print without --config", path="--print_config")
    if record:
        save_run_record(trainer_dir, cfg, diff)
    print(f"# experiment {_CONFIG.value}, resolved")
    print(cfg.debug_string(), end="")
    print(f"# diff from {_CONFIG.value} ({len(diff)} change{'s' if len(diff) != 1 else ''})")
    print("\n".join(diff) if diff else "(none)")
    return 0


def _run_experiment(cfg: Any, diff: Sequence[str], *, trainer_dir: str, record: bool,
                    cluster_spec: Any) -> int:
    """The experiment's root built and run (its ``run()``): its record written once it really
    starts; ``--explain`` / ``--compile_only`` passed on."""
    component = cfg.instantiate()
    run = getattr(component, "run", None)
    if not callable(run):
        raise errors.LaunchFlagError(
            f"the root of experiment {_CONFIG.value!r} builds a {type(component).__qualname__}, "
            "which has no run() method", path="--config",
            suggestion="use --print_config to inspect it, or register a runnable experiment")
    print(f"titanax: experiment {_CONFIG.value}, trainer dir {trainer_dir}", flush=True)

    def on_start() -> None:
        if record:
            save_run_record(trainer_dir, cfg, diff)

    extra = {"explain": True} if _EXPLAIN.value else {}
    if _COMPILE_ONLY.value:
        if "compile_only" not in inspect.signature(run).parameters or _EXPLAIN.value:
            raise errors.LaunchFlagError(
                "--compile_only compiles an Engine's train step from shapes"
                + (", and --explain compiles it on the first batch: choose one" if _EXPLAIN.value
                   else f"; experiment {_CONFIG.value!r} builds a "
                        f"{type(component).__qualname__}"), path="--compile_only",
                suggestion="drop one of the two flags" if _EXPLAIN.value else
                "use it with an Engine experiment")
        extra["compile_only"] = True
    if "on_start" in inspect.signature(run).parameters:
        extra["on_start"] = on_start
    else:  # A root of its own making: its run() starts right away.
        on_start()
    result = run(trainer_dir=trainer_dir, cluster=cluster_spec, **extra)
    return result if isinstance(result, int) else 0


def _resolved_config():
    """The experiment's config with the file's and the command line's overrides, validated;
    and its diff from the named experiment."""
    named = registry.get_config(_CONFIG.value)
    cfg = named.clone()
    file_overrides = (config_file.read_overrides(_CONFIG_FILE.value, cfg)
                      if _CONFIG_FILE.value else [])
    cfg = overrides_lib.apply_overrides(cfg, file_overrides, prefix="config")
    cfg = overrides_lib.apply_overrides(cfg, _OVERRIDES)
    if getattr(cfg, "init_from", None):
        cfg = _model_from_hf(cfg, file_overrides + list(_OVERRIDES))
    from titanax.train import inputs  # pylint: disable=import-outside-toplevel
    cfg = inputs.complete_from_train_input(cfg)
    cfg.validate()
    return cfg, overrides_lib.config_diff(named, cfg)


def _model_from_hf(cfg, given):
    """``cfg`` with the model of its ``init_from`` directory, the ``model.*`` overrides
    ``given`` applied again on top (the user's word over the checkpoint's); the changes are
    printed."""
    from titanax.hf import fine_tune  # pylint: disable=import-outside-toplevel
    trainer_dir = _TRAINER_DIR.value or os.path.join("runs", _CONFIG.value)
    recorded = os.path.join(trainer_dir, "config.json")
    if os.path.isfile(recorded):
        from titanax.train.saved_run import read_run_config  # pylint: disable=import-outside-toplevel
        recorded = read_run_config(trainer_dir)
    else:
        recorded = None
    derived = fine_tune.derive_model(cfg, recorded=recorded)
    # model.vocab_size=None asks for the data's vocabulary: with init_from, the checkpoint's
    # table is the model's (config.json says it), not something to leave unset again.
    derived = overrides_lib.apply_overrides(
        derived, [o for o in given if (o.path == "model" or o.path.startswith("model."))
                  and not (o.path == "model.vocab_size" and o.text.strip() == "None")])
    if recorded is None:  # A fresh run loads the weights: their shapes are checked now.
        fine_tune.check_model_matches(derived.model, derived.init_from)
    derived = fine_tune.with_model_tokenizer(derived, given=given)
    changed = [f"model.{line}" for line in overrides_lib.config_diff(cfg.model, derived.model)]
    print(f"titanax: model from {derived.init_from}/config.json ({len(changed)} change"
          f"{'s' if len(changed) != 1 else ''} to the experiment's):"
          + "".join(f"\n  {line}" for line in changed), flush=True)
    return derived


def _check_entry_point_text() -> None:
    if not all(_MODULE.value.partition(":")[::2]):
        raise errors.LaunchFlagError(f"must be module:function, got {_MODULE.value!r}",
                                     path="--module", suggestion="e.g. --module=my_script:main")


def _user_entry_point():
    """``--module=package.module:function``, imported (the current folder is searched)."""
    module_name, _, function_name = _MODULE.value.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise errors.LaunchFlagError(f"cannot import {module_name!r}: {e}", path="--module",
                                     suggestion="run from the folder that holds it, or put it "
                                                "on PYTHONPATH") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise errors.LaunchFlagError(f"{module_name} has no function {function_name!r}",
                                     path="--module", suggestion="name a function main(config)")
    return function


def _check_local_processes(cluster_spec: cluster.ClusterSpec) -> bool:
    """Whether this launch spawns a local job (--local_processes > 1)."""
    count = _LOCAL_PROCESSES.value
    if count is None:
        return False
    local_processes.check_count(count)
    if cluster_spec.source != "single-process" and count > 1:
        raise errors.LaunchFlagError(
            f"--local_processes starts its own job, but this process is already in one "
            f"({cluster_spec.describe()})", path="--local_processes",
            suggestion="drop --local_processes, or the cluster flags / TITANAX_* variables")
    return count > 1


def _check_emit_flags(cluster_spec: cluster.ClusterSpec) -> None:
    """``--emit`` and its flags, before anything is built."""
    if _EMIT.value is None:
        given = [f"--{flag.name}" for flag in (_NODES, _DEVICES_PER_NODE, _IMAGE)
                 if flag.value is not None]
        if given:
            raise errors.LaunchFlagError(
                f"{given[0]} only shapes a manifest", path=given[0],
                suggestion="add --emit=slurm or --emit=jobset, or drop it")
        return
    manifests.check_target(_EMIT.value)
    if _IMAGE.value is not None and not _IMAGE.value.strip():
        raise errors.LaunchFlagError("is empty", path="--image",
                                     suggestion="name the container image (it must hold Titanax)")
    for flag in (_NODES, _DEVICES_PER_NODE):
        if flag.value is not None:
            manifests.check_count(flag.value, flag=f"--{flag.name}")
    conflicting = [name for name, given in (
        ("--local_processes", _LOCAL_PROCESSES.value is not None),
        ("--print_config", _PRINT_CONFIG.value), ("--list", _LIST.value),
        ("--devices_per_node", _DEVICES_PER_NODE.value is not None and
         _CPU_DEVICES.value is not None)) if given]
    if cluster_spec.source in ("flags", "environment"):
        conflicting.append("--coordinator_address" if cluster_spec.source == "flags"
                           else cluster.ENV_COORDINATOR)
    if conflicting:
        raise errors.LaunchFlagError(
            f"--emit writes a manifest that sets the job's processes and devices itself; "
            f"{conflicting[0]} does not go with it", path=conflicting[0],
            suggestion="drop it (with --cpu_devices=K the nodes simulate K devices each; "
                       "--devices_per_node counts GPUs)")


def _emit_manifest(cfg: Any, *, trainer_dir: str) -> int:
    """``--emit``: the manifest of this run on stdout (the command's config already resolved
    and validated, and its mesh checked against the job's devices: a mistake shows here, not
    on the cluster)."""
    nodes = _NODES.value or 1
    gpus = _CPU_DEVICES.value is None
    per_node = (_DEVICES_PER_NODE.value or manifests.DEFAULT_GPUS_PER_NODE) if gpus \
        else _CPU_DEVICES.value
    mesh = getattr(cfg, "mesh", None)
    if mesh is not None and getattr(mesh, "devices", "all") in (None, "all"):
        try:
            mesh.instantiate().resolved_shape(nodes * per_node)
        except errors.MeshError as e:
            raise errors.MeshError(
                f"{e.message}, in the manifest's job of {nodes} x {per_node} devices",
                path=e.path, suggestion="give the job devices the mesh fits (--nodes, "
                "--devices_per_node or --cpu_devices), or change the mesh") from e
    args = command_args.without_flags(_ARGS, ("emit", "nodes", "devices_per_node",
                                                     "image"))
    if _TRAINER_DIR.value is None:  # (Written out: on a cluster it must be shared storage.)
        args.append(f"--trainer_dir={trainer_dir}")
    run = manifests.ClusterRun(experiment=_CONFIG.value or "user_module", args=tuple(args),
                               nodes=nodes, devices_per_node=per_node, gpus=gpus,
                               image=_IMAGE.value or manifests.DEFAULT_IMAGE)
    print(manifests.emit(_EMIT.value, run), end="")
    return 0


def _run_local_job() -> int:
    count = _LOCAL_PROCESSES.value
    gpus_per_process = 0
    if _CPU_DEVICES.value is None:
        gpus = local_processes.visible_gpus()
        if not gpus or gpus % count:
            raise errors.LaunchFlagError(
                f"{count} local processes need devices: {gpus} GPU(s) are visible"
                + (f", which do not split evenly over {count} processes" if gpus else ""),
                path="--local_processes",
                suggestion=f"add --cpu_devices=K for K simulated CPU devices per process, "
                           f"e.g. --local_processes={count} --cpu_devices=4")
        gpus_per_process = gpus // count
    commands = local_processes.child_commands(
        _ARGS, module="titanax.launch", count=count, port=local_processes.free_port(),
        cpu_devices=_CPU_DEVICES.value)
    preemption.exit_if_requested("before the processes started")
    return local_processes.run_local_job(commands, gpus_per_process=gpus_per_process)


def _join_job(cluster_spec: cluster.ClusterSpec, *, quiet: bool) -> None:
    """Joins the job before anything touches devices; with ``quiet`` only process 0 keeps
    stdout (a user's --module decides itself what each process prints)."""
    if not cluster_spec.is_multi_process:
        return
    distributed.initialize(spec=cluster_spec)
    import jax  # pylint: disable=import-outside-toplevel
    if quiet and jax.process_index() != 0:
        sys.stdout = open(os.devnull, "w", encoding="utf-8")  # pylint: disable=consider-using-with
    preemption.hand_over_to_job()


def _explain_peer_loss(error) -> None:
    """A peer's death often surfaces as this process's failed collective (gloo: "connection
    closed by peer"): in a job, let the peer watch name the lost process (it ends this one)."""
    watch = distributed.watch()
    if watch is not None and type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):
        watch.explain_failure()


def main(argv: Sequence[str]) -> None:
    # jax reports at INFO level every backend it could not find (TPU on a GPU host...), and Orbax
    # logs every save step at INFO through absl: keep stderr for warnings unless --verbosity asks.
    command_line.quiet_libraries()
    try:
        status = launch(argv)
    except errors.TitanaxError as e:
        _explain_peer_loss(e.__cause__)
        _remove_made_dirs_left_empty()
        if _SHOW_TRACEBACK.value:
            raise
        print(f"titanax.launch: error: {e.format()}", file=sys.stderr)
        print("(run with --show_traceback for the Python traceback)", file=sys.stderr)
        distributed.finish_after_error()
        sys.exit(2)
    except SystemExit as e:
        # A clean stop, or an agreed preemption without a checkpoint (128 + SIGTERM): every
        # process of the job reaches it after the same step, then they leave together.
        if not e.code or e.code == 128 + signal.SIGTERM:
            distributed.finish()
        raise
    except Exception as e:  # pylint: disable=broad-except
        _explain_peer_loss(e)
        raise
    distributed.finish()
    if status:  # (A job whose processes failed: the directory they left empty goes too.)
        _remove_made_dirs_left_empty()
    sys.exit(status)


def run_main() -> None:
    """Entry point of ``python -m titanax.launch`` and the ``titanax-launch`` script."""
    preemption.install_early()
    console.protect_standard_streams()  # Printing never stops a run (a closed pipe, a full disk).
    local_processes.die_with_launcher()
    garbage_collection.tune_garbage_collection()
    # absl's --help lists the flags of the main module and prints its docstring; for the
    # installed script the main module is a generated stub, so name ours as the main one.
    main_module = sys.modules.get("__main__")
    if main_module is not None and not getattr(main_module, "__doc__", None):
        main_module.__doc__ = __doc__
    for name in ("config", "list", "config_module", "print_config", "trainer_dir", "cpu_devices",
                 "coordinator_address", "num_processes", "process_id", "local_processes",
                 "config_file", "module", "explain", "compile_only", "show_traceback", "emit",
                 "nodes", "devices_per_node", "image"):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    try:
        app.run(main, flags_parser=_parse_flags)
    except SystemExit as e:
        if not e.code:
            _leave_now()
        goodput.CLOCK.write()  # (A failed or stopped run's accounting to its end.)
        raise


def _leave_now() -> None:
    """A finished run's process ends here: its exit handlers run and its streams are flushed,
    then it leaves without the interpreter's teardown (~0.4 s of freeing jax's backend and
    modules: after the run's last goodput record, nobody's time)."""
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    goodput.CLOCK.write()  # (The run's accounting to its last moment.)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)  # pylint: disable=protected-access


if __name__ == "__main__":
    run_main()
