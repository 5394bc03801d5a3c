"""Goals printed with their verdict computed from the figure measured, never asserted."""

from __future__ import annotations

import operator

OPS = {">=": operator.ge, "<=": operator.le, "<": operator.lt, ">": operator.gt}


def goal(value: float, op: str, target: float) -> str:
    """``(goal >= 0.85: met)`` or ``... NOT met`` for ``value op target``; a NaN
    figure (a failed or empty measurement) is never met."""
    return f"(goal {op} {target:g}: {'met' if OPS[op](value, target) else 'NOT met'})"
