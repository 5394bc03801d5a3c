"""The one error type for expected stage failures.

A stage raises a :class:`StageError` (or a subclass such as ``PackError``) for a
failure the user can fix: a missing input, an invalid param, a tokenizer that does
not match the model. ``pipeline.runner`` catches ``StageError`` alone and prints
it as one line, ``error: stage <name> failed: <message>``, with exit code 2.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class StageError(RuntimeError):
    """An expected failure: its message names the problem and the fix; the runner
    prints it as one line."""
