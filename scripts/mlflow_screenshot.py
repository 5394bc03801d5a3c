"""Screenshot of the MLflow UI comparing two pipeline runs (for the README).

    python scripts/mlflow_screenshot.py [--db mlflow.db] [--out docs/mlflow-compare.png]

Starts a real ``mlflow server`` on 127.0.0.1 over the SQLite database ``--db``
(one worker, no job runner: see ENVIRONMENT.md), opens its compare-runs page for
the two most recent finished runs named ``--run-name`` in headless Chromium, and
saves a PNG. If the database holds fewer than two such runs, two small demo runs
are logged into a temporary database instead, so the project's own ``mlflow.db``
is never written to. The server is stopped on the way out, even on errors.

Needs Debian's Chromium (``apt-get install chromium``); ``--chromium`` names another
binary. Exit codes: 0 written, 1 failed (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Flags Chromium needs here: no sandbox as root in a container, no GPU, and no
# background traffic (this machine has no network beyond localhost).
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars", "--force-device-scale-factor=1",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_runs(uri: str, run_name: str, n: int = 2) -> tuple[str, list[str]] | None:
    """``(experiment id, run ids)`` of the ``n`` most recent finished runs named
    ``run_name`` that have metrics (a no-op pipeline run has none), in one
    experiment, or None if no experiment has that many."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    for exp in client.search_experiments():
        runs = client.search_runs(
            [exp.experiment_id],
            filter_string=f"attributes.run_name = '{run_name}' and attributes.status = 'FINISHED'",
            order_by=["attributes.start_time DESC"], max_results=100,
        )
        runs = [r for r in runs if r.data.metrics][:n]
        if len(runs) >= n:
            return exp.experiment_id, [r.info.run_id for r in runs]
    return None


def log_demo_runs(uri: str, run_name: str) -> tuple[str, list[str]]:
    """Two small runs that differ in a few params, with loss curves and final
    metrics, in experiment ``llm-pipeline-demo`` at ``uri``."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param, RunTag

    client = MlflowClient(uri)
    exp_id = client.create_experiment("llm-pipeline-demo")
    ids = []
    now = int(time.time() * 1000)
    for i, (lr, layers) in enumerate([(3e-3, 4), (1e-3, 6)]):
        run = client.create_run(exp_id, run_name=run_name, tags={"demo": "true"})
        loss = [4.0 * math.exp(-step * lr * 6) + 1.6 - 0.1 * i for step in range(0, 301, 10)]
        metrics = [Metric("pretrain.loss", v, now + s, s * 10) for s, v in enumerate(loss)]
        metrics += [Metric("pretrain.val_loss", loss[-1] + 0.08, now, 300),
                    Metric("pack.tokens", 1_902_344, now, 0), Metric("clean.docs_out", 5_211, now, 0)]
        params = [Param("pretrain.lr", str(lr)), Param("pretrain.model.n_layer", str(layers)),
                  Param("pretrain.max_steps", "300"), Param("pack.seq_len", "256")]
        client.log_batch(run.info.run_id, metrics=metrics, params=params,
                         tags=[RunTag("pipeline.stages_ran", "pretrain" if i else "ingest,clean,tokenizer,pack,pretrain")])
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    return exp_id, ids


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"mlflow server not healthy after {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def compare_url(base: str, exp_id: str, run_ids: list[str]) -> str:
    query = urllib.parse.urlencode({"runs": json.dumps(run_ids), "experiments": json.dumps([exp_id])})
    return f"{base}/#/compare-runs?{query}"


def screenshot(chromium: str, url: str, out: Path, size: str, budget_ms: int) -> None:
    """Render ``url`` in headless Chromium and save ``out``. The virtual time
    budget lets the single-page app fetch and draw its data before the shot."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size}",
               f"--virtual-time-budget={budget_ms}", f"--screenshot={out}", url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0 or not out.exists() or out.stat().st_size < 10_000:
        raise RuntimeError(f"chromium failed ({proc.returncode}): {proc.stderr.strip()[-1500:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/mlflow_screenshot.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", type=Path, default=ROOT / "mlflow.db", help="SQLite database with the runs")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "mlflow-compare.png")
    parser.add_argument("--run-name", default="pipeline", help="compare the two latest runs with this name")
    parser.add_argument("--demo", action="store_true", help="always use demo runs in a temporary database")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--size", default="1600,2000", help="window size W,H")
    parser.add_argument("--budget-ms", type=int, default=20000, help="virtual time for the page to settle")
    args = parser.parse_args(argv)
    if not Path(args.chromium).exists():
        print(f"error: no Chromium at {args.chromium}; apt-get install chromium", file=sys.stderr)
        return 1

    tmp = Path(tempfile.mkdtemp(prefix="mlflow-shot-"))
    db = args.db.resolve()
    found = None if args.demo or not db.exists() else find_runs(f"sqlite:///{db}", args.run_name)
    if found is None:
        db = tmp / "demo.db"
        found = log_demo_runs(f"sqlite:///{db}", args.run_name)
        print(f"fewer than two '{args.run_name}' runs in {args.db}; using demo runs in {db}")
    exp_id, run_ids = found

    port = free_port()
    mlflow_bin = Path(sys.executable).with_name("mlflow")
    cmd = [str(mlflow_bin) if mlflow_bin.exists() else "mlflow", "server",
           "--backend-store-uri", f"sqlite:///{db}", "--artifacts-destination", str(db.parent / "mlartifacts"),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, server, timeout_s=120)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        url = compare_url(base, exp_id, run_ids)
        screenshot(args.chromium, url, args.out.resolve(), args.size, args.budget_ms)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        print(f"error: {err} (server log: {tmp / 'server.log'})", file=sys.stderr)
        return 1
    finally:
        stop(server)
        log.close()
    print(f"wrote {args.out} comparing runs {', '.join(run_ids)} ({url})")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
