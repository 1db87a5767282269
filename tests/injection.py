"""Fault injection for tests: wrap a callable so that one of its calls raises."""


def fail_on_call(fn, k: int, message: str):
    """`fn` whose k-th call (1-based) raises RuntimeError(message); the others pass through."""
    calls = {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == k:
            raise RuntimeError(message)
        return fn(*args, **kwargs)

    return wrapped
