"""``python flows/watchdog.py PID PGID GRACE_S``: once its parent, process PID,
is gone, stop process group PGID: SIGTERM, then SIGKILL if any member outlives
GRACE_S seconds.

:func:`flows.runtime.stream_command` starts one beside each stage, in a session
of its own, and kills it when the stage ends. It covers what the flow's own
clean-up cannot: the flow process killed outright (SIGKILL from Prefect's runner
when a cancelled run outlives the runner's grace, or from the OOM killer). DVC
killed with it would leave its stage running. A parent-death signal
(``pipeline.files.die_with_parent``) on ``dvc`` would reach dvc alone, not the
stage it started, and the kernel sends it when the *thread* that started dvc
exits, which under Prefect need not be the process. Standard library only, so it
starts in milliseconds."""

import os
import signal
import sys
import time


def main(parent: int, pgid: int, grace_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)  # ProcessLookupError once the whole group is gone
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
