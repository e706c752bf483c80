"""What every ``python -m titanax.<command>`` does around its body (launch, export, generate,
pretokenize, train_tokenizer).

- Standard output and error never stop a command (``observe/console.py``): a closed pipe or a
  full disk drops the text, not the run.
- A flag mistake -- unknown, misspelled (absl's "Did you mean" names the flag meant), badly
  typed -- is a two-line message and exit status 2, as every other bad input; ``--help`` exits 0.
- jax's backend chatter and absl's INFO logs are kept off stderr unless ``--verbosity`` asks;
  Titanax's own log lines are shown as the kind they are (``titanax: ...`` on stdout for
  information, ``titanax: warning: ...`` on stderr: ``observe/console.py``).
- A ``TitanaxError`` prints as a short message naming what is wrong and exits with status 2 (the
  Python traceback with ``--show_traceback``).
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, Callable, List, Optional, Sequence

from absl import app, flags
from absl import logging as absl_logging

from titanax import errors
from titanax.observe import console
from titanax.runtime import distributed, garbage_collection

# What asks absl for help (absl prints it, then exits 1: not an error here).
HELP_FLAGS = ("--help", "-help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def parse_flags(argv: Sequence[str], *, name: str) -> List[str]:
    """absl's parsing of ``argv`` with Titanax's conventions: a mistake is a short error naming
    the flag and exit status 2; asking for help exits 0. Returns the positional arguments."""
    try:
        return flags.FLAGS(list(argv))
    except flags.Error as e:
        message = str(e)
        named = getattr(e, "flagname", None) or re.match(r"flag --([\w.-]+)", message)
        flag = named if isinstance(named, str) else named.group(1) if named else ""
        print(f"{name}: error: " + (f"--{flag.lstrip('-')}: " if flag else "") + message,
              file=sys.stderr)
        print(f"  suggestion: python -m {name} --help lists the flags"
              + ("; config fields are --config.<path>=<value>" if name == "titanax.launch"
                 else ""), file=sys.stderr)
        sys.exit(2)
    except SystemExit as e:
        if any(arg.split("=")[0] in HELP_FLAGS for arg in list(argv)[1:]):
            sys.exit(0)
        raise e


def quiet_libraries() -> None:
    """jax's backend probing and absl's INFO lines off stderr (unless --verbosity asks); Titanax's
    own log lines shown by kind."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)
    console.show_titanax_logs()


def main_of(body: Callable[[Sequence[str]], int], *, name: str) -> Callable[[Sequence[str]], None]:
    """An ``absl.app.run`` main that runs ``body(argv)`` and exits with its status (call it
    before ``app.run`` parses the flags: it defines ``--show_traceback``); positional
    arguments are refused before the body runs."""
    if "show_traceback" not in flags.FLAGS:
        flags.DEFINE_bool("show_traceback", False, "Print Python tracebacks of Titanax's errors.")

    def main(argv: Sequence[str]) -> None:
        quiet_libraries()
        try:
            if len(argv) > 1:  # Every command takes flags only.
                raise errors.LaunchFlagError(f"unexpected arguments: {' '.join(argv[1:])}",
                                             path="argv",
                                             suggestion="every setting is a --flag (see --help)")
            status = body(argv)
        except errors.TitanaxError as e:
            if flags.FLAGS.show_traceback:
                raise
            print(f"{name}: error: {e.format()}", file=sys.stderr)
            distributed.finish_after_error()
            sys.exit(2)
        sys.exit(status)
    return main


def run(body: Callable[[Sequence[str]], int], *, name: str,
        define_flags: Optional[Callable[[], None]] = None) -> None:
    """The whole of a command's ``if __name__ == "__main__":`` -- streams protected, flags
    defined and parsed (``parse_flags``), ``body`` run (``main_of``)."""
    console.protect_standard_streams()
    garbage_collection.tune_garbage_collection()
    if define_flags is not None:
        define_flags()
    app.run(main_of(body, name=name), flags_parser=lambda argv: parse_flags(argv, name=name))


# --- The flags of commands that load a model (evaluate, generate) ------------------------------

def define_model_source_flags(*, dtype_help: str = "") -> None:
    """``--trainer_dir`` / ``--hf`` (exactly one), ``--step``, ``--model_parallel``,
    ``--dtype`` and ``--cpu_devices``, as every model-loading command names them."""
    flags.DEFINE_string("trainer_dir", None, "A run directory (its newest checkpoint, or --step).")
    flags.DEFINE_string("hf", None, "A Hugging Face model directory.")
    flags.DEFINE_integer("step", None, "Checkpoint step of --trainer_dir (default: newest).")
    flags.DEFINE_integer("model_parallel", 1, "--hf: tensor-parallel size.")
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                      "Params and compute in this dtype (default: float32 for --hf, the run's "
                      "precision for --trainer_dir)" + dtype_help + ".")
    flags.DEFINE_integer("cpu_devices", None, "Simulate this many CPU devices (tests, no "
                         "accelerator).")


def check_model_source_flags(values: Any, *, command: str) -> None:
    """The model-source flags' refusals (exit 2 naming the flag): one source, ``--step`` only
    with a run, ``--model_parallel`` only with an HF directory (a run loads onto its own data
    x TP mesh), and sizes in range."""
    if bool(values.trainer_dir) == bool(values.hf):
        raise errors.LaunchFlagError("give exactly one model source", path="--trainer_dir/--hf",
                                     suggestion="--trainer_dir=<run> or --hf=<HF directory>")
    if values.hf and values.step is not None:
        raise errors.LaunchFlagError("an HF directory has no checkpoint steps", path="--step",
                                     suggestion=f"drop --step, or {command} --trainer_dir=<run>")
    if values.trainer_dir and values.model_parallel != 1:
        raise errors.LaunchFlagError(f"a run {command}s on its own data x TP mesh",
                                     path="--model_parallel",
                                     suggestion="drop --model_parallel for --trainer_dir")
    for name, low in (("step", 0), ("model_parallel", 1), ("cpu_devices", 1)):
        value = getattr(values, name)
        if value is not None and value < low:
            raise errors.LaunchFlagError(f"must be >= {low}, got {value}", path=f"--{name}",
                                         suggestion="give a saved step (ls <run>/checkpoints)"
                                         if name == "step" else "e.g. 8")


def check_seed_flag(seed: Optional[int]) -> None:
    if seed is not None and not 0 <= seed < 2 ** 32:
        raise errors.LaunchFlagError(f"must be in [0, 2**32), got {seed}", path="--seed",
                                     suggestion="e.g. --seed=1")

