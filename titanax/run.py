"""``python -m titanax.run --module=user_script:main``: the seed's entry point for your own script.

The same launcher as ``python -m titanax.launch`` (same flags): it resolves the job's processes
(``--local_processes=N`` spawns them here), joins the job before anything touches devices, and
calls ``main(config)`` in every process -- ``config`` is the experiment named by ``--config``
with its ``--config_file`` / ``--config.*`` overrides applied and validated, or None; a ``main``
that takes a ``trainer_dir`` argument also gets ``--trainer_dir`` (default ``runs/<config>``).

    python -m titanax.run --module=my_script:main --config=gpt_tiny_dp --local_processes=2 --cpu_devices=4
"""

from titanax.launch import run_main

if __name__ == "__main__":
    run_main()
