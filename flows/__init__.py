"""Prefect flows over the DVC pipeline: ``python -m flows.pipeline`` runs it once,
``python -m flows.retrain`` serves it on a cron schedule. ``flows/runtime.py``
holds what they need that does not import Prefect (running a stage, task options,
the summary, the MLflow parent run).

Two Prefect defaults are changed here, before any flow module imports Prefect
(the caller's environment still wins):

* ``PREFECT_SERVER_ANALYTICS_ENABLED=false``: the temporary server's analytics
  ping races its SQLite writes and logs a "database is locked" traceback.
* ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120``: Prefect gives its
  temporary server 20 s to come up; a first start (database migrations) takes
  16-18 s on an idle 2-core machine and more on a busy one, and then the whole
  run fails with "Timed out while attempting to connect to ephemeral Prefect API
  server".
"""

import os

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
