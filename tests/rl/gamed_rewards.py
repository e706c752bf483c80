"""A reward a degenerate completion games, for the samples test: the share of a completion's
characters that are 7 (a policy that prints only 7s scores 1 whatever the sum)."""


def sevens(completions, **kwargs):
    return [text.count("7") / max(len(text), 1) for text in completions]
