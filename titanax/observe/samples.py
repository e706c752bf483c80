"""Sample completions while a sampling objective trains (TRL's ``log_completions``): a few of a
rollout's prompts with their completions and rewards on the console, and appended to
``samples.jsonl`` in the run directory -- a completion that games the reward is seen at the step
it appears, not after the run.

``samples.jsonl`` holds one JSON object per shown completion: ``step`` (the first step that
trains on its rollout), ``prompt``, ``completion`` (text) and, for a rewarded objective,
``reward``. Process 0 shows and writes its own rows (any of the batch's prompts serve). A
resumed run drops the entries from the step it resumes at on (they are sampled again, the same);
a new run moves an earlier run's file aside (``samples.<time>.jsonl``), as the CSV logger does.
The run's loggers get the rows too (``Logger.log_samples``): W&B shows them as a table.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from titanax.utils.files import atomic_write_text, move_aside

FILENAME = "samples.jsonl"
# Characters of a prompt or completion shown on the console (the file keeps the whole text).
SHOWN_CHARS = 72


class SampleLog:
    """Shows and records a rollout's first ``count`` completions every ``every`` steps."""

    def __init__(self, *, trainer_dir: Optional[str], every: int, count: int,
                 writes: bool = True, loggers: Sequence[Any] = ()):
        """``trainer_dir`` None: the console only; ``every`` 0: never; ``writes`` False: this
        process neither prints nor writes (another process does); ``loggers``: the run's
        loggers, each given the rows (``Logger.log_samples``: W&B's table)."""
        self.path = os.path.join(trainer_dir, FILENAME) if trainer_dir else None
        self.every, self.count, self.writes = every, count, writes
        self.loggers = list(loggers)
        self._started = False

    @property
    def shows_any(self) -> bool:
        """Whether this process ever shows a sample (callers skip decoding and asking the
        step when it does not)."""
        return self.writes and self.every > 0 and self.count > 0

    def due(self, *, first_step: int, steps: int) -> bool:
        """Whether the rollout trained on by steps ``first_step``.. ``first_step + steps - 1``
        is shown: the run's first, and each that holds a multiple of ``every``."""
        if not self.shows_any:
            return False
        last = first_step + steps - 1
        return first_step == 1 or last // self.every > (first_step - 1) // self.every

    def show(self, *, step: int, prompts: Sequence[str], completions: Sequence[str],
             rewards: Optional[Sequence[float]] = None) -> None:
        """Prints the first ``count`` of the rollout's completions and appends them to the
        file."""
        entries: List[Dict] = []
        for index, (prompt, completion) in enumerate(zip(prompts, completions)):
            if index == self.count:
                break
            entry = {"step": step, "prompt": prompt, "completion": completion}
            if rewards is not None:
                entry["reward"] = float(rewards[index])
            entries.append(entry)
        print(self._table(step, entries, of=len(completions)), file=sys.stdout, flush=True)
        if self.path is not None:
            self._append(step, entries)
        for logger in self.loggers:
            logger.log_samples(entries, step)

    @staticmethod
    def _table(step: int, entries: List[Dict], *, of: int) -> str:
        lines = [f"samples at step {step} ({len(entries)} of {of} completions):"]
        for entry in entries:
            reward = f"reward {entry['reward']:.4f}  " if "reward" in entry else ""
            lines.append(f"  {reward}prompt {_shown(entry['prompt'])}  "
                         f"completion {_shown(entry['completion'])}")
        return "\n".join(lines)

    def _append(self, step: int, entries: List[Dict]) -> None:
        if not self._started:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            self._start(step)
            self._started = True
        with open(self.path, "a", encoding="utf-8") as f:
            for entry in entries:
                f.write(json.dumps(entry, ensure_ascii=False) + "\n")

    def _start(self, step: int) -> None:
        """Before the run's first entry: an earlier run's file moved aside (a run that starts
        at step 1), or a resumed run's entries from ``step`` on dropped."""
        if not os.path.exists(self.path):
            return
        if step <= 1:
            move_aside(self.path)
            return
        with open(self.path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] < step]
        atomic_write_text(self.path, "".join(kept))


def _shown(text: str) -> str:
    """``text`` as a quoted string (newlines visible), cut to ``SHOWN_CHARS``."""
    quoted = json.dumps(text, ensure_ascii=False)
    return quoted if len(quoted) <= SHOWN_CHARS else quoted[:SHOWN_CHARS - 4] + '..."'
