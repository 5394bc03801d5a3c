"""Progress bars: tqdm, quiet when asked (PIPELINE_PROGRESS=0) and sparse when
stderr is not a terminal, so that CI logs stay readable."""

from __future__ import annotations

import os
import sys
from typing import Any

from tqdm.auto import tqdm


def enabled() -> bool:
    return os.environ.get("PIPELINE_PROGRESS", "1") not in ("0", "false", "no")


def progress(**kwargs: Any) -> tqdm:
    tty = sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.2 if tty else 10.0)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=not enabled(), **kwargs)
