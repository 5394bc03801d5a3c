"""For a stage run in a child process under a private Ray instance: every task on Ray."""


def ray_only(marker: str) -> None:
    """Make the RayExecutor run no task in the stage's own process while the
    instance starts (it waits for the instance instead), and write the file
    ``marker`` once the stage is connected: a test that sees it knows that the
    stage's tasks ran on Ray."""
    from pipeline.data.executor import RayExecutor

    ready = RayExecutor.ready

    def ready_and_mark(self: RayExecutor) -> None:
        ready(self)
        open(marker, "w").close()

    RayExecutor.starting = lambda self: False
    RayExecutor.ready = ready_and_mark


def fails_after(x: int, delay: float, runs: str) -> int:
    """After ``delay`` s, task 0 raises a StageError and the others a ValueError
    of two lines, each leaving a file in the folder ``runs`` and a line on its
    stderr as it raises."""
    import os
    import sys
    import time
    import uuid

    from tests.pipeline.data.test_executor import BadInput

    time.sleep(delay)
    open(os.path.join(runs, f"{x}-{uuid.uuid4().hex}"), "w").close()
    print(f"task {x} of fails_after raises", file=sys.stderr, flush=True)
    if x == 0:
        raise BadInput(f"document {x} is unreadable")
    raise ValueError(f"a bug in task {x}\nwith a second line")


def noisy_square(x: int) -> int:
    """x * x, saying so on the worker's stdout and stderr."""
    import sys

    print(f"noisy_square({x}) on stdout", flush=True)
    print(f"noisy_square({x}) on stderr", file=sys.stderr, flush=True)
    return x * x
