"""The one error type for expected stage failures.

A ``StageError`` is a failure the user can fix: a missing input, an invalid
setting, a damaged checkpoint. Its message names the problem and the fix, and
the stage runner (pipeline/runner.py) prints it as one line, with no traceback,
and exits with code 2. Anything else is a bug and keeps its traceback.
"""


class StageError(RuntimeError):
    """An expected failure whose message names the problem and the fix."""
