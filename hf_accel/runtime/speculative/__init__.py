"""The speculative draft/verify loop that replaces ``generate``: the loop, the call plan, the runner."""
