"""Environments of the agents tests, named by import path as a user's would be."""


class Counter:
    """Answers each turn with the number of turns so far; done after the second."""

    def __init__(self):
        self.turns = 0

    def reset(self, record):
        return [{"role": "user", "content": f"count for {record.get('name', 'you')}"}]

    def step(self, messages):
        self.turns += 1
        return [{"role": "user", "content": str(self.turns)}], 0.5, self.turns >= 2


class NoStep:
    def reset(self, record):
        return []


class NeedsArguments:
    def __init__(self, size):
        self.size = size

    def reset(self, record):
        return []

    def step(self, messages):
        return [], 0.0, True


NOT_A_CLASS = 3


class Echo:
    """Answers with the length of the assistant's last turn; reward 1 per turn; never done."""

    def reset(self, record):
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        assert messages[-1]["role"] == "assistant"
        said = len(messages[-1]["content"])
        return [{"role": "user", "content": f"you said {said}"}], 1.0, False


class Flaky:
    """Raises on the record whose question is "boom"."""

    def reset(self, record):
        return [{"role": "user", "content": record["question"]}]

    def step(self, messages):
        if messages[0]["content"] == "boom":
            raise RuntimeError("the tool server is down")
        return [], 0.0, True


class Digits:
    """The calculator's characters only: answers each turn with a tool message of two digits
    (the turn's length's last and the turn's number), rewarded 0.25 a turn; done after the
    third turn."""

    def __init__(self):
        self.turns = 0

    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages):
        self.turns += 1
        said = messages[-1]["content"]
        answer = [{"role": "tool", "content": f"{len(said) % 10}{self.turns}"}]
        return answer, 0.25, self.turns >= 3


class TwoValues:
    def reset(self, record):
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, messages):
        return [], 1.0


class NotANumber(TwoValues):
    def step(self, messages):
        return [], float("nan"), True


class FailsOnProcessOne(Digits):
    """Digits, except that on process 1 of a job its step raises (one process's records)."""

    def step(self, messages):
        import jax  # pylint: disable=import-outside-toplevel
        if jax.process_index() == 1:
            raise RuntimeError("this process's tool is down")
        return super().step(messages)
