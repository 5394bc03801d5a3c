"""What every stage's ``main()`` shares: load its params section, run, write its
metrics, and turn expected failures into one clear line and exit code 2."""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from pipeline import layout
from pipeline.config import ConfigError, StageConfig, load_params
from pipeline.io import write_json

log = logging.getLogger("pipeline")


class StageError(RuntimeError):
    """An expected failure with a message meant for the user (no traceback)."""


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )


def run_stage(stage: str, body: Callable[[StageConfig], dict], *, expected: tuple[type[BaseException], ...] = ()) -> None:
    """Load ``params.yaml[stage]``, call ``body(cfg) -> metrics``, write
    ``metrics/<stage>.json``. Config errors and ``expected`` errors exit 2 with
    their message rather than a traceback."""
    setup_logging()
    t0 = time.perf_counter()
    try:
        cfg = load_params(stage)
        metrics = body(cfg)
    except (ConfigError, StageError, *expected) as err:
        print(f"error: stage {stage} failed: {err}", file=sys.stderr)
        sys.exit(2)
    metrics = {**metrics, "seconds": round(time.perf_counter() - t0, 3)}
    write_json(layout.metrics_path(stage), metrics)
    log.info("%s done: %s", stage, {k: v for k, v in metrics.items() if not isinstance(v, dict)})
