"""The bound of every count a command takes (``--seeds``, ``--steps``, ``--repeat``, ...), one table:
each is checked before any work (a recipe prepared, a backend described), so 10⁹ seeds is one line
and exit 2, never minutes of checks or a MemoryError. The recipe's own keys keep their bounds in
``xfw.recipe`` (``measure.steps`` in [1, 1e6], ``measure.repeat`` in [1, 1000]); an option that sets
one of those has the same bound here."""

from __future__ import annotations

COUNT_BOUNDS = {
    "seeds": 100,           # as xfw.run.commands.converge.MAX_SEEDS: each seed is an export and two learning curves
    "max_seeds": 100,
    "steps": 1_000_000,     # as measure.steps
    "eval_every": 1_000_000,  # as measure.eval_every
    "eval_samples": 1 << 31,  # as data.eval_samples
    "repeat": 1000,         # as measure.repeat
    "max_micro": 1 << 20,   # the largest micro-batch a doubling search tries
}
"""Largest value of each count option (the smallest is 1)."""


def count_problem(name: str, value, flag: str | None = None) -> str | None:
    """``None`` when ``value`` is an integer in [1, the bound of ``name``]; else the problem in one
    line naming ``flag`` (default ``--name``)."""
    flag = flag or f"--{name.replace('_', '-')}"
    bound = COUNT_BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return f"{flag}: must be an integer >= 1, got {str(value)[:40]}"
    if value > bound:
        return f"{flag}: must be an integer >= 1 and at most {bound:,}, got {value:,}"
    return None
