"""Agents: multi-turn RL with tools and environments (``objectives/agent.py``).

* ``llama_tiny_agent``: a 2-layer Llama-style model from scratch learns three-digit sums
  ("123+456=") with a calculator (``titanax/agents/calculator.py``, bundled with its tokenizer
  and chat format): a turn that is exactly ``<calc>`` calls the tool on the record's operands,
  the tool's answer comes back as a tool message, and the next turn is the answer, rewarded by
  its digits in place (1: the sum). 16 episodes of each of 16 records a step, up to 3 turns of
  5 tokens, 28 tokens an episode, the KL to the starting weights (beta 0.04); data 4 x model 2
  of 8 simulated devices. It learns the call first (~130 steps), then to copy the tool's
  answer: mean reward 0.006 at the start, above 0.9 from step ~650 of its 800 (docs/agents.md,
  section 3). ``--config.objective.environment=titanax.agents.calculator.NoCalculator`` plays
  the same sums with no tool offered.
* ``qwen3_0_6b_agent``: Qwen 3 0.6B with the user's environment and chat-templated records
  (``--config.objective.environment``, ``--config.train_input.source.files``,
  ``--config.init_from``; Qwen's tokenizer via ``--config.train_input.tokenizer.path``): 8
  prompts x 8 episodes of up to 4 turns and 2,048 tokens; FSDP over 8 devices, sized by
  ``--compile_only --cpu_devices=8``.
"""

from titanax.config import register_experiment
from titanax.data.pipeline import Input
from titanax.data.prompts import Prompts
from titanax.modules.models.decoder import Decoder, qwen3_config
from titanax.objectives.agent import Agent
from titanax.parallel.plan import DP, TP, Plan, ZeRO
from titanax.runtime.mesh import MeshSpec

from .rl import grpo_run


@register_experiment
def llama_tiny_agent():
    """A tiny Llama learns to call a calculator for three-digit sums (module docstring)."""
    model = Decoder.default_config().set(
        name="llama", vocab_size=20, max_seq_len=40, num_layers=2, model_dim=64, num_heads=4,
        num_kv_heads=2, hidden_dim=176, norm_eps=1e-5, rope_theta=10000.0)
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(files=["bundled:calculator/prompts.jsonl"],
                                            max_prompt_tokens=12),
        global_batch_size=16)
    prompts.tokenizer.path = "bundled:calculator"
    agent = Agent.default_config().set(
        environment="titanax.agents.calculator.Calculator", max_turns=3, max_tokens=28,
        max_new_tokens=5, num_generations=16, beta=0.04)
    cfg = grpo_run(model=model, prompts=prompts, grpo=agent, steps=800, peak_lr=7e-4,
                   mesh=MeshSpec.default_config().set(axes=("data", "model"), shape=(None, 2)),
                   plan=Plan.default_config().set(data_parallel=DP.default_config(),
                                                  tensor_parallel=TP.default_config()))
    # (The warmup of the run docs/agents.md reports: 25 steps, as for 500.)
    cfg.learner.optimizer.learning_rate.warmup_steps = 25
    return cfg


@register_experiment
def qwen3_0_6b_agent():
    """Qwen 3 0.6B trained as an agent on the user's environment (module docstring)."""
    model = qwen3_config("0.6b", layer_remat_policy="dots_with_no_batch_dims_saveable")
    prompts = Input.default_config().set(
        source=Prompts.default_config().set(chat=True, max_prompt_tokens=512),
        global_batch_size=8)
    agent = Agent.default_config().set(
        environment="titanax.agents.tool_environment.ToolEnvironment", max_turns=4,
        max_tokens=2048, max_new_tokens=512, num_generations=8, beta=0.04)
    plan = Plan.default_config().set(data_parallel=DP.default_config(),
                                     zero=ZeRO.default_config().set(stage=3))
    return grpo_run(model=model, prompts=prompts, grpo=agent, steps=500, peak_lr=1e-6,
                    mesh=MeshSpec.default_config().set(axes=("data",)), plan=plan)
