"""Two processes on loopback each read a disjoint half of every global batch."""

import json
import subprocess
import sys


from titanax.data.pipeline import Input
from titanax.data.sources import MNIST
from tests.environment import child_environment
from tests.runtime.test_distributed import REPO_ROOT, _free_port


def test_two_processes_read_disjoint_halves_whose_union_is_the_single_process_batch(tmp_path):
    port = _free_port()
    env = child_environment()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    workers = [subprocess.Popen([sys.executable, "-m", "tests.data.distributed_data_worker",
                                 str(i), str(port), str(outs[i])], cwd=REPO_ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for i in range(2)]
    logs = [w.communicate(timeout=240)[0] for w in workers]
    for worker, log in zip(workers, logs):
        assert worker.returncode == 0, log[-3000:]
    results = [json.loads(out.read_text()) for out in outs]
    single = Input.default_config().set(source=MNIST.default_config().set(split="test"),
                                        global_batch_size=8, seed=7).instantiate()
    expected = [batch["label"].tolist() for _, batch in zip(range(3), single)]
    for step in range(3):
        halves = [r["local"][step] for r in results]
        assert len(halves[0]) == len(halves[1]) == 4
        assert halves[0] + halves[1] == expected[step]
        assert results[0]["global"][step] == results[1]["global"][step] == expected[step]
    read = [set(r["read"]) for r in results]
    assert read[0] and read[1] and not read[0] & read[1], "each process reads only its rows"
    assert len(read[0] | read[1]) == 24
