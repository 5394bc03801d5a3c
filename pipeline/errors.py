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


class Stopped(BaseException):
    """A SIGTERM (Prefect's timeout, a service manager) raised in a stage's main
    thread, as Python raises KeyboardInterrupt for a Ctrl-C: the stage's
    ``finally`` blocks run (its worker pool shut down, a Ray instance it started
    stopped) and its MLflow run ends KILLED. Not an Exception, so that no
    ``except Exception`` takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def raise_stopped(signum: int, _frame: object) -> None:
    """A signal handler: raise :class:`Stopped` for ``signum`` (install it for SIGTERM)."""
    raise Stopped(signum)
