"""Test setup: 8 simulated CPU devices, a quick XLA backend and jax's persistent compilation
cache.

All must be configured before jax starts, so this runs first and sets them in the environment
(which subprocesses started by tests inherit too: ``tests/environment.py``).
"""

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

from titanax.runtime.cpu_devices import simulate_cpu_devices  # noqa: E402

from tests.environment import TEST_PROCESS_FLAGS  # noqa: E402

TEST_DEVICE_COUNT = 8
# Compiling dominates the suite's time (the tests' programs are tiny); LLVM's optimisations of
# the CPU code halve it at no cost to what is tested: the HLO -- every collective, every buffer
# the memory tests read -- is XLA's, before the backend (measured: 22 parity tests 280 s -> 139 s).
# The older fusion code generation halves it again (tests/environment.py, and the
# ``fusion_emitters`` fixture for the one program it computes less exactly).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_PROCESS_FLAGS}".strip()
simulate_cpu_devices(TEST_DEVICE_COUNT)

_CACHE_DIR = os.environ.get("TITANAX_TEST_COMPILATION_CACHE",
                            os.path.join(REPO_ROOT, ".cache", "jax_compilation"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# Subprocesses started by tests import the checkout, not an installed copy.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p)

# The heaviest files first (measured, --durations, cold cache, 2026-12-02: every file of 15 s or
# more): the two workers take whole files (pytest.ini), and a heavy file started last would run
# alone at the end of the suite.
HEAVIEST_FIRST = ("tests/test_multi_process.py", "tests/test_todays_experiments.py",
                  "tests/train/test_pipeline_parity.py", "tests/rl/test_grpo_launch.py",
                  "tests/modules/models/test_layer_pattern.py", "tests/decoding/test_engine.py",
                  "tests/parallel/test_context_parallel.py",
                  "tests/harness/test_lm_eval_parity.py", "tests/test_muon_experiments.py",
                  "tests/hf/test_fine_tune.py", "tests/agents/test_agent_launch.py",
                  "tests/test_moe_experiments.py", "tests/train/test_sharded_state.py",
                  "tests/decoding/test_engine_on_mesh.py", "tests/hf/test_import.py",
                  "tests/train/test_preference_training.py", "tests/test_fp8_experiments.py",
                  "tests/test_pipeline_experiments.py", "tests/parallel/test_expert_parallel.py",
                  "tests/harness/test_lm_eval_evaler.py", "tests/hf/test_generate.py",
                  "tests/hf/test_lora_export.py", "tests/io/test_local_tier.py",
                  "tests/decoding/test_paged_decoder.py", "tests/train/test_lora_training.py",
                  "tests/test_distillation_doc.py", "tests/test_launch_errors.py",
                  "tests/modules/layers/test_token_prediction.py",
                  "tests/modules/layers/test_gated_delta_rule.py",
                  "tests/test_context_experiments.py", "tests/io/test_preemption.py",
                  "tests/test_fine_tune_doc.py", "tests/modules/test_lora.py",
                  "tests/rl/test_grpo_training.py", "tests/test_preference_doc.py",
                  "tests/modules/adapters/test_flax_nnx.py", "tests/runtime/test_manifests.py",
                  "tests/test_flax_experiments.py", "tests/config/test_value_sweep.py",
                  "tests/data/test_packed_resume.py", "tests/train/test_decoder_training.py",
                  "tests/agents/test_agents_doc.py", "tests/test_launch.py",
                  "tests/modules/layers/test_blockwise_attention.py",
                  "tests/hf/test_grpo_parity.py", "tests/modules/layers/test_gated_deltanet.py",
                  "tests/test_evaluation_doc.py", "tests/train/test_state_updates.py",
                  "tests/io/test_checkpointer.py", "tests/decoding/test_rollout_sampler.py",
                  "tests/test_examples.py", "tests/modules/models/test_packing.py",
                  "tests/agents/test_agent_training.py", "tests/modules/layers/test_moe.py",
                  "tests/benchmarks/test_peers.py",
                  "tests/modules/layers/test_latent_attention.py",
                  "tests/modules/layers/test_layers.py", "tests/rl/test_async_rollouts.py",
                  "tests/harness/test_task_index.py", "tests/test_generate_prompts_file.py",
                  "tests/observe/test_goodput.py")


def pytest_collection_finish(session):  # pylint: disable=unused-argument
    """Every test module imported: freeze them and make young collections rarer, as Titanax's
    commands do (titanax/runtime/garbage_collection.py; measured here: a compile-heavy test file
    takes ~12% less CPU)."""
    from titanax.runtime.garbage_collection import tune_garbage_collection  # pylint: disable=import-outside-toplevel
    tune_garbage_collection()


def pytest_collection_modifyitems(items):
    rank = {path: index for index, path in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="module")
def float64_numerics():
    """The module's engines store and compute in float64, in jax's 64-bit mode (parity tests:
    ``tests/numerics.py``). Use with ``pytestmark = pytest.mark.usefixtures("float64_numerics")``."""
    from tests.numerics import float64_numerics as mode  # pylint: disable=import-outside-toplevel
    with mode():
        yield


@pytest.fixture
def fusion_emitters():
    """The test's programs compile with XLA:CPU's newer fusion emitters (the test process uses
    the older, faster-compiling ones: tests/environment.py): the circular pipeline schedule's
    program, which the older ones compute to 2e-11 of the loss instead of float64's 1e-16.
    Programs compiled here get their own compilation-cache entries (the option is in the key)."""
    from jax._src import compiler  # pylint: disable=import-outside-toplevel
    plain = compiler.get_compile_options

    def with_fusion_emitters(*args, env_options_overrides=None, **kwargs):
        overrides = dict(env_options_overrides or {})
        overrides.setdefault("xla_cpu_use_fusion_emitters", True)
        return plain(*args, env_options_overrides=overrides, **kwargs)

    compiler.get_compile_options = with_fusion_emitters
    try:
        yield
    finally:
        compiler.get_compile_options = plain


@pytest.fixture(autouse=True)
def _circular_schedule_tests_compile_with_the_fusion_emitters(request):
    """A test named for the circular pipeline schedule (its name or a parameter's id) gets
    ``fusion_emitters``; one that runs it among others asks by name."""
    if "circular" in request.node.name:
        request.getfixturevalue("fusion_emitters")


@pytest.fixture
def float32_numerics():
    """This test runs in float32 inside a float64 module: what it measures is the float32
    program itself (its collectives' count and bytes, its buffers), not a parity."""
    import jax  # pylint: disable=import-outside-toplevel
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
