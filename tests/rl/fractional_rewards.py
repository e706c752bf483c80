"""A reward for the launcher tests: a completion's length in thirds (1/3, 2/3: no float32 holds
them exactly, so a process that rounded them would be seen)."""


def thirds(completion_ids, **kwargs):
    return [len(ids) / 3.0 for ids in completion_ids]
