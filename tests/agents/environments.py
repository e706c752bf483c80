"""Environments of the agents tests, named by import path as a user's would be."""


class Counter:
    """Answers each turn with the number of turns so far; done after the second."""

    def __init__(self):
        self.turns = 0

    def reset(self, record):
        return [{"role": "user", "content": f"count for {record['name']}"}]

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
