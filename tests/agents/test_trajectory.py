"""An episode's ids grown turn by turn (titanax/agents/trajectory.py): the assistant's sampled
ids kept exactly -- even where encoding their text would give others -- and trained, with their
log-probs; the template's rendering of each answer (tools' responses, a user's turn) between
them, not trained; the whole decoding to the template's rendering of the conversation, the
tools listed. A template that rewrites a past turn is refused."""

import numpy as np
import pytest

from titanax.agents.tool_schema import json_schema
from titanax.agents.trajectory import Trajectory
from titanax.data import chat
from titanax.data.tokenizer import Tokenizer
from tests.agents import tools
from tests.agents.conftest import TOOLS_CHATML

# The same, but a past assistant turn is written without its first line (as templates that drop
# past reasoning do).
REWRITING = TOOLS_CHATML.replace(
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}",
    "{% elif message['role'] == 'assistant' and not loop.last %}<|im_start|>assistant\n"
    "{{ message['content'].split('\\n')[-1] }}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}")


def _tokenizer(path, template=None):
    return Tokenizer.default_config().set(path=path, chat_template=template).instantiate()


def _sampled(tokenizer, text, *, char_by_char=False):
    """Ids a model could have sampled for ``text``, its end token after: by character, ids
    the text's own encoding would not give."""
    pieces = list(text) if char_by_char else [text]
    return [i for piece in pieces for i in tokenizer.encode(piece)] + tokenizer.chat_end_ids()


def test_sampled_ids_are_kept_and_answers_are_the_templates_text(tokenizer_dir):
    tokenizer = _tokenizer(tokenizer_dir)
    schemas = [json_schema(tools.add, where="tools[0]")]
    opening = [("system", "You add."), ("user", "What is 2 + 3.5?")]
    episode = Trajectory(tokenizer=tokenizer, opening=opening, tools=schemas)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3.5}}\n</tool_call>'
    first = _sampled(tokenizer, call, char_by_char=True)
    assert first[:-1] != list(tokenizer.encode(call))  # (Not the text's own encoding.)
    content = episode.add_turn(first, logps=np.linspace(-1, -0.1, len(first)))
    assert content == call
    episode.add_answer([("tool", "5.5"), ("user", "And in words?")])
    second = _sampled(tokenizer, "Five and a half.")
    episode.add_turn(second, logps=[-0.5] * len(second))
    ids, trained, logps = episode.arrays()

    # The sampled ids, where they were appended, are the trained ones, with their log-probs.
    opening_ids = tokenizer.encode_markup(tokenizer.chat_template.render(
        opening, add_generation_prompt=True, tools=schemas), start=True)
    start = len(opening_ids)
    assert ids[:start].tolist() == opening_ids
    assert ids[start:start + len(first)].tolist() == first
    assert ids[-len(second):].tolist() == second
    assert trained.sum() == len(first) + len(second)
    assert trained[start:start + len(first)].all() and trained[-len(second):].all()
    np.testing.assert_allclose(logps[start:start + len(first)],
                               np.linspace(-1, -0.1, len(first)), rtol=1e-6)
    assert (logps[~trained] == 0).all()
    # The answers between: the template's text after the first turn's end token through the
    # next generation prompt.
    between = tokenizer.decode(ids[start + len(first):-len(second)])
    assert between == ("\n<|im_start|>user\n<tool_response>\n5.5\n</tool_response><|im_end|>\n"
                       "<|im_start|>user\nAnd in words?<|im_end|>\n<|im_start|>assistant\n")
    # The whole: the template's rendering of the conversation (it ends its last turn with a
    # newline the model did not sample), the tools listed.
    whole = tokenizer.chat_template.render(
        [*opening, ("assistant", call), ("tool", "5.5"), ("user", "And in words?"),
         ("assistant", "Five and a half.")], tools=schemas)
    assert tokenizer.decode(ids) + "\n" == whole
    assert '"name": "add"' in whole


def test_a_template_that_rewrites_a_past_turn_is_refused(tokenizer_dir):
    tokenizer = _tokenizer(tokenizer_dir, template=REWRITING)
    episode = Trajectory(tokenizer=tokenizer, opening=[("user", "Hi")])
    turn = _sampled(tokenizer, "Thinking.\nHello.")
    episode.add_turn(turn, logps=[0.0] * len(turn))
    with pytest.raises(chat.TemplateError, match="assistant turn 1"):
        episode.add_answer([("user", "Again")])


def test_turns_and_answers_alternate(tokenizer_dir):
    episode = Trajectory(tokenizer=_tokenizer(tokenizer_dir), opening=[("user", "Hi")])
    with pytest.raises(ValueError, match="an answer follows an assistant turn"):
        episode.add_answer([("user", "x")])
    with pytest.raises(ValueError, match="2 sampled ids and 1 log-probs"):
        episode.add_turn([5, 6], logps=[0.0])
    episode.add_turn([5, 6], logps=[0.0, 0.0])
    with pytest.raises(ValueError, match="a turn follows a turn"):
        episode.add_turn([5], logps=[0.0])


# Llama 3.1's layout: a header per message, <|eot_id|> after each; a tool's answer as the
# "ipython" role (as Meta's template writes it).
LLAMA3 = ("{{ bos_token }}{% for message in messages %}<|start_header_id|>"
          "{{ 'ipython' if message['role'] == 'tool' else message['role'] }}"
          "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>")


@pytest.fixture(scope="module")
def templates(tokenizer_dir, tmp_path_factory):
    """Tokenizers of each supported chat format: Qwen's ChatML with tools, Llama 3.1's, and the
    bundled calculator's (a character vocabulary, role tokens)."""
    from tests import chatml_tokenizer  # pylint: disable=import-outside-toplevel
    llama3 = chatml_tokenizer.write(str(tmp_path_factory.mktemp("llama3_tok")),
                                    template=LLAMA3, specials=LLAMA3_SPECIALS,
                                    eos="<|eot_id|>", bos="<|begin_of_text|>")
    return {"chatml_tools": _tokenizer(tokenizer_dir), "llama3": _tokenizer(llama3),
            "calculator": _tokenizer("bundled:calculator")}


# Per format: the opening, the model's turns and the environment's answers between them.
CONVERSATIONS = {
    "chatml_tools": ([("user", "Add 2 and 3.")], ["Let me see.", "It is 5."],
                     [[("tool", "5"), ("user", "Sure?")]]),
    "llama3": ([("system", "Be brief."), ("user", "Add 2 and 3.")], ["Let me see.", "5."],
               [[("tool", "5")]]),
    "calculator": ([("user", "123+356=")], ["<calc>", "479"], [[("tool", "479")]]),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_each_formats_trained_ids_are_the_sampled_ids_and_the_templates_answers(templates,
                                                                                 name):
    """The ids an episode trains on: the opening's rendering, each turn's sampled ids exactly
    (sampled piece by piece where the text's own encoding would merge them), the template's
    rendering of each answer between -- the whole decoding to the template's rendering of the
    conversation."""
    tokenizer = templates[name]
    opening, turns, answers = CONVERSATIONS[name]
    episode = Trajectory(tokenizer=tokenizer, opening=opening)
    pieces, messages = [], list(opening)
    for index, text in enumerate(turns):
        sampled = (_sampled(tokenizer, text, char_by_char=True) if name != "calculator" else
                   tokenizer.encode_markup(text, start=False) + tokenizer.chat_end_ids())
        episode.add_turn(sampled, logps=[-0.25] * len(sampled))
        messages.append(("assistant", text))
        pieces.append(sampled)
        if index < len(answers):
            assert episode.add_answer(answers[index])
            messages += answers[index]
    ids, trained, logps = episode.arrays()
    assert ids[trained].tolist() == [i for piece in pieces for i in piece]
    assert (logps[trained] == -0.25).all() and (logps[~trained] == 0).all()
    opening_ids = tokenizer.encode_markup(tokenizer.chat_template.render(
        opening, add_generation_prompt=True), start=True)
    assert ids[:len(opening_ids)].tolist() == opening_ids
    whole = tokenizer.chat_template.render(messages)
    decoded = tokenizer.decode(ids)
    assert whole.startswith(decoded) and len(whole) - len(decoded) <= 1, (whole, decoded)
    # Between the turns: the template's own text for the answers, untrained.
    first_end = int(np.flatnonzero(trained)[len(pieces[0]) - 1])
    between = ids[first_end + 1:len(ids) - len(pieces[-1])]
    assert not trained[first_end + 1:len(ids) - len(pieces[-1])].any()
    shown = tokenizer.decode(between)
    assert all(content.strip() in shown for _, content in answers[0])
