"""A command for tests/runtime/test_forked_children.py: prints its flags, whether it runs on its
launcher's imports (a module only the launcher imported), and exits with ``--exit_code`` (or is
interrupted: ``--interrupt``)."""

import os
import sys

from absl import app, flags

_GREETING = flags.DEFINE_string("greeting", "default", "Printed.")
_COUNT = flags.DEFINE_integer("count", 1, "Printed.")
_EXIT_CODE = flags.DEFINE_integer("exit_code", 0, "This command's exit status.")
_INTERRUPT = flags.DEFINE_bool("interrupt", False, "Raise KeyboardInterrupt instead.")


def main(argv):
    del argv
    inherited = "tests.runtime.launcher_only" in sys.modules
    print(f"greeting={_GREETING.value} count={_COUNT.value} parent={os.getppid()} "
          f"inherited={inherited} session_leader={os.getsid(0) == os.getpid()} "
          f"env={os.environ.get('FORKED_CHILD_TEST')}")
    print("to stderr", file=sys.stderr)
    if _INTERRUPT.value:
        raise KeyboardInterrupt
    return _EXIT_CODE.value


if __name__ == "__main__":
    app.run(main)
