"""A user's script for ``python -m titanax.run --module=tests.harness.evaler_main:main`` (run by
tests/harness/test_lm_eval_evaler.py, not by pytest): the configured run with an lm-eval evaler
over the local tasks in ./tasks every 2 steps, in every process of the job."""

import os

from tests.harness import local_tasks


def main(config, trainer_dir):
    from titanax.harness.evaler import LMEvalEvaler  # pylint: disable=import-outside-toplevel
    config.evalers = {"lm_eval": LMEvalEvaler.default_config().set(
        tasks=list(local_tasks.TASKS), include_path=os.path.abspath("tasks"), every_n_steps=2,
        max_gen_toks=8)}
    engine = config.instantiate(trainer_dir=trainer_dir)
    engine.fit()
    engine.close()
