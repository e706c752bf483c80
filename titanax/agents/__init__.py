"""Multi-turn RL with tools and environments: the environment protocol (``environment.py``),
tools described from their Python signatures (``tool_schema.py``), and tool calls read out of an
assistant's turn and answered (``tool_calls.py``)."""
