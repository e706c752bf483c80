"""What every ``python -m titanax.<command>`` does around its body (export, generate).

jax's backend chatter and absl's INFO logs are kept off stderr unless ``--verbosity`` asks; a
``TitanaxError`` prints as a short message naming what is wrong and exits with status 2 (the
Python traceback with ``--show_traceback``), like the launcher.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

from absl import flags
from absl import logging as absl_logging

from titanax import errors

def main_of(body: Callable[[Sequence[str]], int], *, name: str) -> Callable[[Sequence[str]], None]:
    """An ``absl.app.run`` main that runs ``body(argv)`` and exits with its status (call it
    before ``app.run`` parses the flags: it defines ``--show_traceback``); positional
    arguments are refused before the body runs."""
    if "show_traceback" not in flags.FLAGS:
        flags.DEFINE_bool("show_traceback", False, "Print Python tracebacks of Titanax's errors.")

    def main(argv: Sequence[str]) -> None:
        logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
        if not flags.FLAGS["verbosity"].present:
            absl_logging.set_verbosity(absl_logging.WARNING)
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
            sys.exit(2)
        sys.exit(status)
    return main
