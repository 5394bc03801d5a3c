"""flows/retrain.py against a real Prefect server: the cron schedule fires, a run
with nothing stale is a no-op, new files in data/raw are picked up, two runs of
the deployment never overlap, and stopping ``serve`` leaves the schedule active.

Everything runs in subprocesses: a ``prefect server`` on 127.0.0.1 at a free
port with its own PREFECT_HOME, and ``python -m flows.retrain`` serving against
it in a throw-away project copy. Assertions go through the server's REST API
(what Prefect's Python client wraps; the CLI's ``flow-run ls`` fails with 422),
so Prefect is never imported into the test process. Every process is stopped,
by process group, even when the test fails."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from flows.runtime import changed_stages, project_lock, stop_group
from tests.conftest import BIN, ROOT, project_copy

pytestmark = pytest.mark.slow

TERMINAL = {"COMPLETED", "CANCELLED", "FAILED", "CRASHED"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``check()`` once a second until it returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited with {proc.returncode}\n{_tail(log)}")
        result = check()
        if result:
            return result
        time.sleep(1)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}\n{_tail(log)}")


def _tail(log: Path | None, n: int = 6000) -> str:
    return log.read_text(errors="replace")[-n:] if log is not None and log.exists() else ""


class Api:
    """The few REST calls the test needs."""

    def __init__(self, url: str) -> None:
        import httpx

        self.url = url
        self.http = httpx.Client(base_url=url, timeout=15)

    def _send(self, method: str, path: str, **kw):
        """One API call, retried on 503/429 as Prefect's own client does: the
        server answers 503 while its SQLite database is briefly locked, and
        rolls the request back, so a retry cannot create anything twice."""
        for attempt in range(6):
            r = self.http.request(method, path, **kw)
            if r.status_code not in (429, 503):
                break
            time.sleep(0.5 * 2**attempt)
        r.raise_for_status()
        return r

    def healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except Exception:  # not listening yet
            return False

    def deployment(self, flow: str, name: str) -> dict | None:
        r = self.http.get(f"/deployments/name/{flow}/{name}")
        return r.json() if r.status_code == 200 else None

    def flow_runs(self, **filters) -> list[dict]:
        r = self._send("POST", "/flow_runs/filter", json={**filters, "sort": "EXPECTED_START_TIME_ASC", "limit": 200})
        return r.json()

    def deployment_runs(self, deployment_id: str) -> list[dict]:
        return self.flow_runs(flow_runs={"deployment_id": {"any_": [deployment_id]}})

    def pipeline_runs(self) -> list[dict]:
        return self.flow_runs(flows={"name": {"any_": ["pipeline"]}})

    def create_run(self, deployment_id: str) -> str:
        return self._send("POST", f"/deployments/{deployment_id}/create_flow_run", json={}).json()["id"]

    def run(self, run_id: str) -> dict:
        return self._send("GET", f"/flow_runs/{run_id}").json()

    def state_types(self, run_id: str) -> list[str]:
        return [s["type"] for s in self.http.get("/flow_run_states/", params={"flow_run_id": run_id}).json()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    log = home / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        api = Api(f"http://127.0.0.1:{port}/api")
        # Healthy in 8-14 s on an idle machine; a busy shared CPU has taken 26 s.
        wait_for("the Prefect server", api.healthy, 150, proc, log)
        yield api
    finally:
        stop_group(proc, 20)


@pytest.fixture
def serve(server, tmp_path):
    """Start ``python -m flows.retrain ARGS`` in ``cwd``; stop it at the end."""
    procs: list[subprocess.Popen] = []

    def start(cwd: Path, *args: str) -> tuple[subprocess.Popen, Path]:
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "PREFECT_API_URL": server.url,
            "PREFECT_HOME": str(tmp_path / "serve-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",  # default 10 s; keeps the test short
            "PIPELINE_TRACKING": "0",
            "PYTHONUNBUFFERED": "1",
        }
        log = tmp_path / f"serve-{len(procs)}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "flows.retrain", *args], cwd=cwd, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        procs.append(proc)
        return proc, log

    yield start
    for proc in procs:
        stop_group(proc, 20)


def ran(api: Api, run: dict) -> bool:
    return "RUNNING" in api.state_types(run["id"])


def intervals_overlap(runs: list[dict]) -> bool:
    spans = sorted((datetime.fromisoformat(r["start_time"]), datetime.fromisoformat(r["end_time"])) for r in runs)
    return any(b_start < a_end for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def ingest_files(root: Path) -> int:
    return json.loads((root / "metrics" / "ingest.json").read_text())["files"]


@pytest.mark.timeout(480)
def test_cron_deployment_fires_picks_up_new_data_and_runs_never_overlap(server, serve, tmp_path):
    root = project_copy(tmp_path / "proj", {
        "ingest.sources": [{"path": "data/raw/*.txt", "format": "text"}],
        "clean.num_workers": 1,
    })
    (root / "data" / "raw" / "a.txt").write_text("def first():\n    return 'the first document of the corpus'\n")
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PIPELINE_TRACKING": "0"}
    # Bring ingest and clean up to date first, so that the scheduled run has nothing to do.
    r = subprocess.run([str(BIN / "dvc"), "repro", "clean"], cwd=root, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert ingest_files(root) == 1
    lock = (root / "dvc.lock").read_bytes()

    proc, log = serve(root, "--cron", "* * * * *", "--targets", "clean")
    dep = wait_for("the deployment", lambda: server.deployment("retrain", "retrain"), 90, proc, log)
    assert [s["schedule"]["cron"] for s in dep["schedules"]] == ["* * * * *"]
    assert dep["global_concurrency_limit"]["limit"] == 1
    assert dep["concurrency_options"]["collision_strategy"] == "CANCEL_NEW"

    # 1. The cron schedule fires at the next minute boundary (<= 60 s away) and the run completes.
    def scheduled_done():
        return [r for r in server.deployment_runs(dep["id"]) if r["auto_scheduled"] and r["state_type"] == "COMPLETED"]

    tick = wait_for("a scheduled run to complete", scheduled_done, 100, proc, log)[0]
    assert datetime.fromisoformat(tick["expected_start_time"]).second == 0, "cron runs start on the minute"
    assert (root / "dvc.lock").read_bytes() == lock, "nothing was stale, so nothing ran"
    assert server.pipeline_runs() == [], "a run with nothing stale starts no pipeline"

    # 2. New data arrives; two runs are requested at once. The limit lets one through.
    (root / "data" / "raw" / "b.txt").write_text("def second():\n    return 'a second document arrives later'\n")
    mine = [server.create_run(dep["id"]), server.create_run(dep["id"])]

    def settled():
        runs = server.deployment_runs(dep["id"])
        mine_done = all(server.run(i)["state_type"] in TERMINAL for i in mine)
        busy = any(r["state_type"] in ("PENDING", "RUNNING", "CANCELLING") for r in runs)
        return runs if mine_done and not busy else None

    runs = wait_for("both requested runs to finish", settled, 180, proc, log)
    states = sorted(server.run(i)["state_type"] for i in mine)
    assert "CANCELLED" in states, f"two simultaneous runs, and neither was refused: {states}\n{_tail(log)}"
    executed = [r for r in runs if r["state_type"] in TERMINAL and ran(server, r)]
    assert not intervals_overlap(executed), "runs of the deployment overlapped"
    for run_id in mine:
        if server.run(run_id)["state_type"] == "CANCELLED":
            assert not ran(server, server.run(run_id)), "a refused run never starts"

    # 3. DVC saw the new file: ingest (and what follows it) reran, and is now up to date.
    assert ingest_files(root) == 2
    assert not {k for k in changed_stages(root) if k in ("ingest", "clean")}
    assert len(server.pipeline_runs()) >= 1

    # 4. Stopping serve (SIGTERM, as a service manager does) keeps the schedule on.
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"serve did not stop within 30 s of SIGTERM\n{_tail(log)}")
    dep = server.deployment("retrain", "retrain")
    assert dep["paused"] is False and all(s["active"] for s in dep["schedules"])


def test_serve_refuses_without_a_real_server_and_rejects_bad_cron(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.retrain", "--cron", "0 3 * * *"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "needs a running Prefect server" in r.stderr, r.stderr[-3000:]
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"  # nothing listens on the discard port
    r = subprocess.run([sys.executable, "-m", "flows.retrain", "--cron", "0 3 * * *"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "error: no Prefect server at http://127.0.0.1:9/api: start one with `make prefect-server`"], r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "flows.retrain", "--cron", "every night"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "--cron 'every night'" in r.stderr, r.stderr[-3000:]


@pytest.mark.parametrize("status, body", [(404, b'{"detail":"Not Found"}'), (200, b"<html>a web UI</html>")])
def test_serve_refuses_a_url_where_something_else_than_a_prefect_api_answers(tmp_path, status, body):
    """Another service on the port, or the server's URL without /api: serve went on
    and failed deep in Prefect's client with pages of HTTP errors. The URL's
    password is not printed."""
    import http.server
    import threading

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://bob:hunter2@127.0.0.1:{httpd.server_port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": url}
    try:
        r = subprocess.run([sys.executable, "-m", "flows.retrain", "--cron", "0 3 * * *"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    finally:
        httpd.shutdown()
    shown = url.replace("hunter2", "***")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"error: {shown} is not a Prefect API: GET /health answered HTTP {status}; expected a Prefect server's URL "
        "ending in /api, e.g. http://127.0.0.1:4200/api"], r.stderr[-3000:]


@pytest.mark.parametrize("args, message", [
    (["--cron", "0 3 * * * *"], "a cron expression has 5 fields"),  # the 6th would be seconds
    (["--cron", "0 3 31 2 *"], "never fires"),
    (["--cron", ""], "--cron '': empty"),  # was the default schedule, silently
    (["--timezone", ""], "--timezone '': empty"),  # was "ZoneInfo keys must be normalized relative paths, got: "
    (["--targets", "nope"], "--targets: unknown stage(s) nope"),
    (["--once", "--targets", "nope"], "--targets: unknown stage(s) nope"),
    (["--once", "--root", "/nonexistent"], "--root /nonexistent: no such directory"),
])
def test_bad_schedule_targets_or_root_are_refused_before_a_deployment_or_run_exists(tmp_path, args, message):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never contacted
    r = subprocess.run([sys.executable, "-m", "flows.retrain", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr[-3000:]
    last = r.stderr.splitlines()[-1]
    assert last.startswith("python -m flows.retrain: error: ") and message in last, r.stderr[-3000:]


WAIT_FOR_GO = """
import pathlib, time
pathlib.Path("started").write_text("1")
while not pathlib.Path("go").exists():
    time.sleep(0.1)
pathlib.Path("out.txt").write_text("done")
"""


@pytest.mark.timeout(300)
def test_a_retrain_run_waits_for_the_flow_run_whose_stage_is_running(tmp_path):
    """A retrain run asked `dvc status` before taking the project's flow lock;
    while another flow run's stage ran, DVC refused (its outputs "are busy") and
    the retrain run failed instead of waiting its turn, as the README says it does."""
    from tests.flows.test_pipeline_flow import dvc_project

    root = dvc_project(tmp_path / "proj", {
        "slow": {"cmd": "python wait.py", "deps": ["wait.py"], "outs": ["out.txt"]},
        "other": {"cmd": "cp in.txt copy.txt", "deps": ["in.txt"], "outs": ["copy.txt"]},
    }, {"wait.py": WAIT_FOR_GO, "in.txt": "new data\n"})
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PIPELINE_TRACKING": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    seen: list[str] = []
    # What a `make flow` run holds while its stage runs: the flow lock, and DVC's lock on the stage's outputs.
    with project_lock(root, seen.append, "the test's flow run"):
        repro = subprocess.Popen([str(BIN / "dvc"), "repro", "--single-item", "slow"], cwd=root, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_for("the running stage", (root / "started").exists, 60, repro)
            proc = subprocess.Popen([sys.executable, "-m", "flows.retrain", "--once"], cwd=root, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            for line in proc.stdout:
                seen.append(line)
                if "waiting for the test's flow run" in line:
                    break
            else:
                pytest.fail("the retrain run did not wait for the flow run:\n" + "".join(seen[-40:]))
            (root / "go").touch()
            assert repro.wait(timeout=60) == 0
        finally:
            stop_group(repro, 5)
    try:
        out = "".join(seen) + proc.communicate(timeout=200)[0]
    finally:
        stop_group(proc, 5)
    assert proc.returncode == 0, out[-4000:]
    assert "DVC reports stale: other; running the pipeline" in out, out[-4000:]
    assert (root / "copy.txt").read_text() == "new data\n"


@pytest.mark.timeout(240)
def test_a_retrain_run_whose_stage_fails_ends_failed_with_the_stage_error_not_tracebacks(tmp_path):
    from tests.flows.test_pipeline_flow import FAILS, dvc_project

    # writes under models/: a training stage, so not retried
    root = dvc_project(tmp_path / "proj", {"bad": {"cmd": "python bad.py", "deps": ["bad.py"],
                                                   "outs": ["models/bad.txt"]}}, {"bad.py": FAILS})
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PIPELINE_TRACKING": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run([sys.executable, "-m", "flows.retrain", "--once"], cwd=root, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=200)
    assert r.returncode == 1, r.stdout[-4000:]
    assert "Traceback" not in r.stdout, r.stdout[-6000:]
    why = "stage bad: error: stage bad failed: bad.lr must be > 0, got -1"
    assert r.stdout.count(f"Finished in state Failed('{why}')") == 2, r.stdout[-4000:]  # pipeline, then retrain


@pytest.mark.timeout(240)
def test_a_retrain_run_with_nothing_stale_runs_no_pipeline(tmp_path):
    from tests.flows.test_pipeline_flow import dvc_project

    root = dvc_project(tmp_path / "proj", {
        "copy": {"cmd": "cp in.txt models/out.txt", "deps": ["in.txt"], "outs": ["models/out.txt"]},
    }, {"in.txt": "x\n", "models/.keep": ""})
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PIPELINE_TRACKING": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    subprocess.run([str(BIN / "dvc"), "repro"], cwd=root, env=env, check=True, capture_output=True)
    mtime = (root / "models" / "out.txt").stat().st_mtime_ns
    r = subprocess.run([sys.executable, "-m", "flows.retrain", "--once"], cwd=root, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=200)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "DVC reports every stage up to date (copy); nothing to retrain" in r.stdout, r.stdout[-4000:]
    assert "for flow 'pipeline'" not in r.stdout and "Running stage" not in r.stdout, r.stdout[-4000:]
    assert (root / "models" / "out.txt").stat().st_mtime_ns == mtime


@pytest.mark.timeout(240)
def test_a_retrain_run_while_a_dvc_repro_by_hand_holds_the_lock_fails_in_one_line(tmp_path):
    """`dvc repro` run by hand takes no flow lock, only DVC's: `dvc status` then
    fails, and the retrain run failed with a traceback of a LineageError holding
    DVC's whole stderr. Now the run ends Failed with DVC's reason on one line
    (the next tick tries again)."""
    from tests.flows.test_pipeline_flow import dvc_project

    root = dvc_project(tmp_path / "proj", {"slow": {"cmd": "python wait.py", "deps": ["wait.py"], "outs": ["out.txt"]}},
                       {"wait.py": WAIT_FOR_GO})
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PREFECT_HOME": str(tmp_path / "home"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PIPELINE_TRACKING": "0", "PYTHONUNBUFFERED": "1"}
    env.pop("PREFECT_API_URL", None)
    repro = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=root, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for("the running stage", (root / "started").exists, 60, repro)
        r = subprocess.run([sys.executable, "-m", "flows.retrain", "--once"], cwd=root, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=200)
        (root / "go").touch()
        assert repro.wait(timeout=60) == 0
    finally:
        stop_group(repro, 5)
    assert r.returncode == 1, r.stdout[-4000:]
    assert "Traceback" not in r.stdout, r.stdout[-6000:]
    assert re.search(r"Finished in state Failed\(\"dvc status failed in \S+: ERROR: '\S+out\.txt' is busy, it is being "
                     rf"blocked by: \(PID {repro.pid}\): \S*dvc repro", r.stdout), r.stdout[-4000:]
