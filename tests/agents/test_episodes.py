"""Episodes played to their end (titanax/agents/episodes.py) with the decode engine on a tiny
model: each round samples every running episode's turn, the environments answer on a thread
pool; an episode ends when its environment says done, after max_turns, or when its tokens run
out -- and records which; its reward is the sum of its turns'. An environment that raises is
reported naming its class, record and sample."""

import jax
import numpy as np
import pytest

from titanax import errors
from titanax.agents.environment import load_environment
from titanax.agents.episodes import engine_turns, play
from titanax.decoding.engine import DecodeEngine
from titanax.data.tokenizer import Tokenizer
from titanax.modules.models.decoder import Decoder
from titanax.modules.module import functional

RECORDS = [{"question": "What is one and one?"}, {"question": "Say hi."}]


@pytest.fixture(scope="module")
def setup(tokenizer_dir):
    """The tokenizer, and an engine over a random model whose turns end after a few tokens:
    its head's rows all zero but the end token's, the mean direction of its final hidden
    states, scaled so that its logit is about 4 -- a turn ends with probability near e^4 /
    (e^4 + vocabulary) per token, and draws uniformly from the rest otherwise."""
    tokenizer = Tokenizer.default_config().set(path=tokenizer_dir).instantiate()
    end = tokenizer.chat_end_ids()[0]
    model = Decoder.default_config().set(
        name="d", vocab_size=tokenizer.vocab_size, max_seq_len=512, model_dim=32,
        num_heads=4, num_kv_heads=2, hidden_dim=48, num_layers=2).instantiate(parent=None)
    params = jax.jit(model.initialize_parameters_recursively)(jax.random.PRNGKey(0))
    head = np.zeros(params["lm_head"]["weight"].shape, np.float32)
    head[:32] = np.eye(32)  # (Logits 0..31 read the final hidden state.)
    probe = {**params, "lm_head": {"weight": jax.numpy.asarray(head)}}
    ids = jax.random.randint(jax.random.PRNGKey(1), (8, 32), 0, tokenizer.vocab_size)
    hidden = np.asarray(functional(model, None, probe, (ids,), method="logits",
                                   is_training=False)[0])[..., :32].reshape(-1, 32)
    mean = hidden.mean(axis=0)
    head[:] = 0
    head[end] = 4.0 * mean / np.dot(mean, mean)
    params = {**params, "lm_head": {"weight": jax.numpy.asarray(head)}}
    engine = DecodeEngine(model=model, params=params, pool_tokens=4096, block_size=16,
                          slots=8, seed=3)
    return tokenizer, engine_turns(engine, temperature=1.0, max_new_tokens=24, stop_ids=[end])


def _play(setup, environment, **changes):
    tokenizer, sample_turns = setup
    path = f"tests.agents.environments.{environment}"
    settings = dict(records=RECORDS, tokenizer=tokenizer, samples=2,
                    make_environment=lambda: load_environment(path, where="objective.environment"),
                    sample_turns=sample_turns, max_turns=3, max_tokens=400)
    return play(**{**settings, **changes})


def test_episodes_end_as_their_environment_turns_and_tokens_say(setup):
    episodes = _play(setup, "Counter")  # (done after its second answer)
    assert [(e.record, e.sample) for e in episodes] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    for episode in episodes:
        turns = episode.trajectory.turns
        assert episode.ended_by in ("done", "tokens"), episode.ended_by
        if episode.ended_by == "done":
            assert turns == 2 and episode.rewards == [0.5, 0.5] and episode.reward == 1.0
        ids, trained, logps = episode.trajectory.arrays()
        assert trained.sum() > 0 and (logps[trained] <= 0).all() and (logps[~trained] == 0).all()
    assert any(e.ended_by == "done" for e in episodes)
    # An environment that is never done: every episode ends at max_turns or out of tokens.
    endless = _play(setup, "Echo", max_turns=2)
    assert {e.ended_by for e in endless} <= {"max_turns", "tokens"}
    assert all(e.trajectory.turns <= 2 and e.reward == len(e.rewards) for e in endless)
    assert any(e.ended_by == "max_turns" for e in endless)
    for episode in endless:  # (No answer after the last turn: nothing would read it.)
        if episode.ended_by == "max_turns":
            assert episode.trajectory.ids[-1] == episode.trajectory.end_id
            assert len(episode.rewards) == 2
    # An answer that would fill the episode's tokens is not appended: ended by tokens.
    opening = max(len(e.trajectory.ids) for e in endless)
    cramped = _play(setup, "Echo", max_tokens=opening + 26, max_turns=12)
    assert {e.ended_by for e in cramped} == {"tokens"}
    assert all(len(e.trajectory.ids) <= opening + 26 for e in cramped)
    dropped = [e for e in cramped if len(e.rewards) == e.trajectory.turns and  # (Answered,)
               e.trajectory.ids[-1] == e.trajectory.end_id]  # (its answer not appended.)
    assert dropped and all(len(e.trajectory.messages) == 2 * e.trajectory.turns - 1
                           for e in dropped)  # (The opening, and each earlier turn's pair.)
    # No room for a turn after the opening: refused naming the record and the field.
    with pytest.raises(errors.AgentError, match=r"objective.max_tokens: Echo.reset \(record 0, "
                                                r"sample 0\) opens with \d+ tokens"):
        _play(setup, "Echo", max_tokens=5)


def test_a_template_that_cannot_grow_the_conversation_is_named(setup, tokenizer_dir):
    from tests.agents.test_trajectory import REWRITING  # pylint: disable=import-outside-toplevel
    tokenizer = Tokenizer.default_config().set(path=tokenizer_dir,
                                               chat_template=REWRITING).instantiate()
    with pytest.raises(errors.AgentError, match=r"train_input.tokenizer: rendering the "
                                                r"conversation of Echo.step \(record 0"):
        _play(setup, "Echo", tokenizer=tokenizer, samples=1)


def test_an_environment_that_raises_is_named_with_its_record_and_sample(setup):
    records = [{"question": "fine"}, {"question": "boom"}]
    with pytest.raises(errors.AgentError,
                       match=r"Flaky.step \(record 1, sample 0\) raised RuntimeError: the tool "
                             r"server is down"):
        _play(setup, "Flaky", records=records)
