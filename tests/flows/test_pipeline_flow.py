"""flows/pipeline.py, flows/runtime.py and pipeline/tracking/lineage.py: the stage
graph comes from DVC, data stages get retries and training stages don't, timeouts kill the whole stage, a
second run is a no-op by DVC's own account, and MLflow gets one parent run per
flow run with each stage's run nested under it.

Prefect is never imported into the test process (it reconfigures the root logger
on import); the flow runs as ``python -m flows.pipeline`` subprocesses, as a user
would run it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from flows import runtime
from pipeline.tracking import lineage
from pipeline.tracking.lineage import StageInfo
from tests.conftest import BIN, ROOT, project_copy

DATA_STAGES = ["ingest", "clean", "tokenizer", "pack"]
TINY = {
    "ingest.max_bytes": 300_000,
    "clean.executor.num_workers": 1,
    "tokenizer.vocab_size": 512,
    "tokenizer.sample_bytes": 200_000,
    "tokenizer.eval_bytes": 50_000,
    "pack.executor.num_workers": 1,
}


# --------------------------------------------------------------------------- helpers


def dvc_project(path: Path, stages: dict, files: dict[str, str] | None = None) -> Path:
    """A DVC project without git at ``path`` with ``stages`` as its dvc.yaml."""
    from dvc.repo import Repo

    path.mkdir(parents=True, exist_ok=True)
    Repo.init(str(path), no_scm=True).close()
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(textwrap.dedent(text))
    return path


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict[str, str]:
    """A Prefect home and an MLflow database for the module's flow runs: their
    first-use migrations cost 5-10 s each, so they are paid once. Tests keep
    apart by MLflow experiment."""
    d = tmp_path_factory.mktemp("flow-state")
    return {"PREFECT_HOME": str(d / "prefect-home"), "MLFLOW_TRACKING_URI": f"sqlite:///{d / 'mlflow.db'}"}


def flow_env(shared: dict[str, str], experiment: str, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        **shared,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PIPELINE_TRACKING": "1",
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false",
        "PYTHONUNBUFFERED": "1",
        **extra,
    }
    env.pop("PREFECT_API_URL", None)  # the temporary server, even if the caller uses a real one
    return env


def run_flow(cwd: Path, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.pipeline", *args], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


def run_flow_behind_a_held_lock(cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The flow started while another run holds the project's flow lock: it must
    say whose the lock is and wait, and run its stages once the lock is free."""
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    with runtime.project_lock(cwd, seen.append, "the test's flow run"):
        for line in proc.stdout:
            seen.append(line)
            assert not re.search(r"Running stage|stage \S+: (ran|restored|skipped) in", line), \
                "a stage ran while another flow run held the lock:\n" + "".join(seen[-40:])
            if f"waiting for the test's flow run (pid {os.getpid()}, started " in line:
                break
        else:
            raise AssertionError("the flow never waited for the lock:\n" + "".join(seen[-40:]))
    out = "".join(seen) + proc.stdout.read()
    proc.wait(timeout=300)
    assert "the project's flow lock is free after" in out
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, None)


def statuses(output: str) -> dict[str, str]:
    """Stage -> status from the flow's log lines ``stage X: ran in 1.2 s``."""
    return dict(re.findall(r"stage (\S+): (ran|restored|skipped) in", output))


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has already exited


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"], max_results=1000)


# --------------------------------------------------------------------------- the DAG


def test_stage_order_is_dvc_dependency_order_not_declaration_order(tmp_path):
    # Declared downstream-first: only DVC's graph can put them in order.
    root = dvc_project(tmp_path, {
        "report": {"cmd": "cat b.txt c.txt > report.txt", "deps": ["b.txt", "c.txt"], "outs": ["report.txt"]},
        "c": {"cmd": "cp a.txt c.txt", "deps": ["a.txt"], "outs": ["c.txt"]},
        "b": {"cmd": "cp a.txt b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
        "a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]},
    })
    stages = lineage.load_stages(root)
    assert [s.name for s in stages] == ["a", "c", "b", "report"]  # ties keep dvc.yaml order
    assert set(stages[-1].upstream) == {"b", "c"}
    assert [s.name for s in lineage.select(stages, ["b"])] == ["a", "b"]
    assert lineage.descendants(stages, "a") == {"b", "c", "report"}
    assert lineage.descendants(stages, "report") == set()
    with pytest.raises(lineage.LineageError, match="unknown stage"):
        lineage.select(stages, ["nope"])


def test_real_pipeline_order_and_which_stages_are_data_stages():
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    stages = lineage.load_stages(ROOT)
    names = [s.name for s in stages]
    assert sorted(names) == sorted(spec), "every dvc.yaml stage is run, and nothing else"
    produced = {}
    for s in stages:
        for out in s.outs + s.metrics:
            produced[out] = s.name
    for s in stages:  # every stage comes after the stages whose outputs it reads
        for dep in s.deps:
            owner = next((o for p, o in produced.items() if dep == p or dep.startswith(p + "/")), None)
            if owner is not None:
                assert names.index(owner) < names.index(s.name), f"{s.name} reads {dep} from {owner}"
    data = [s.name for s in stages if s.is_data_stage]
    assert data[:4] == DATA_STAGES
    assert "pretrain" not in data and "sft" not in data


def test_task_options_retry_data_stages_only_and_time_out_as_configured():
    data = StageInfo("clean", "x", deps=("data/ingest/docs.parquet",), outs=("data/clean",))
    train = StageInfo("pretrain", "x", deps=("data/packed",), outs=("models/pretrain",))
    evaluate = StageInfo("evaluate", "x", deps=("models/sft",), outs=("data/evaluate",))
    assert data.is_data_stage and not train.is_data_stage and not evaluate.is_data_stage

    opts = runtime.task_options(data, retries=3, retry_delay_s=5)
    assert (opts["retries"], opts["retry_delay_seconds"]) == (3, 5)
    assert opts["timeout_seconds"] == runtime.DATA_TIMEOUT_S
    assert opts["task_run_name"] == "clean"
    opts = runtime.task_options(train, retries=3)
    assert (opts["retries"], opts["timeout_seconds"]) == (0, None)

    assert runtime.task_options(train, timeouts={"pretrain": 60})["timeout_seconds"] == 60
    assert runtime.task_options(train, timeouts={"*": 90})["timeout_seconds"] == 90
    assert runtime.task_options(data, timeouts={"clean": 0, "*": 90})["timeout_seconds"] is None
    assert runtime.task_options(train, retries=2, retry_stages=["pretrain"])["retries"] == 2
    assert runtime.task_options(data, retries=2, retry_stages=[])["retries"] == 0


def test_parse_timeouts_takes_finite_non_negative_seconds():
    assert runtime.parse_timeouts(["pretrain=3600", "*=0.5", "a=b=0"]) == {"pretrain": 3600.0, "*": 0.5, "a=b": 0.0}
    longest = f"{runtime.MAX_SECONDS:.0f}"
    assert runtime.parse_timeouts([f"pretrain={longest}"]) == {"pretrain": runtime.MAX_SECONDS}
    # Past MAX_SECONDS Prefect's timer raised OverflowError as the task started.
    for bad in ("prep=-5", "prep=nan", "prep=inf", "prep=x", "prep", "=5", "prep=1e12", f"prep={longest}1"):
        with pytest.raises(ValueError, match="STAGE=SECONDS"):
            runtime.parse_timeouts([bad])


def test_check_stage_args_names_the_option_with_an_unknown_stage(tmp_path):
    root = dvc_project(tmp_path / "proj", {
        "a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]},
        "b": {"cmd": "cp a.txt b.txt", "deps": ["a.txt"], "outs": ["b.txt"]},
    })
    assert [s.name for s in runtime.check_stage_args(root, ["a"], {"b": 5, "*": 1}, ["b"])] == ["a"]
    assert [s.name for s in runtime.check_stage_args(root)] == ["a", "b"]
    for kwargs, option in [({"targets": ["nope"]}, "--targets"), ({"timeouts": {"trian": 1}}, "--timeout"),
                           ({"retry_stages": ["a", "x"]}, "--retry-stages")]:
        with pytest.raises(ValueError, match=f"^{option}: unknown stage"):
            runtime.check_stage_args(root, **kwargs)
    with pytest.raises(ValueError, match="^--root .*: no such directory"):
        runtime.check_stage_args(tmp_path / "missing")
    with pytest.raises(ValueError, match="^--root: .* not a DVC project"):
        runtime.check_stage_args(tmp_path)


def test_root_is_the_project_that_the_folder_is_in(tmp_path):
    root = dvc_project(tmp_path / "proj", {"a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]}})
    (root / "sub" / "deeper").mkdir(parents=True)
    assert runtime.resolve_root(root) == root.resolve()
    assert runtime.resolve_root(root / "sub" / "deeper") == root.resolve()
    with pytest.raises(ValueError, match="^--root .*: no such directory"):
        runtime.resolve_root(tmp_path / "missing")
    with pytest.raises(ValueError, match="^--root: .* not a DVC project"):
        runtime.resolve_root(tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_flow_started_in_a_sub_folder_runs_the_project(tmp_path, shared):
    """It ran `dvc repro` in the sub-folder, where every stage failed after its
    retries ("'dvc.yaml' does not exist"), and left a .dvc folder there (which
    DVC then takes for a project of its own)."""
    root = dvc_project(tmp_path / "proj", {"a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]}})
    sub = root / "notes"
    sub.mkdir()
    r = run_flow(sub, flow_env(shared, "sub-folder"), "--retries", "0")
    assert r.returncode == 0, r.stdout[-4000:]
    assert statuses(r.stdout) == {"a": "ran"} and (root / "a.txt").read_text() == "a\n"
    assert sorted(p.name for p in sub.iterdir()) == [], "the flow wrote into the sub-folder"
    assert (root / runtime.FLOW_LOCK).exists()


def test_cli_refuses_bad_arguments_in_one_line_before_starting_prefect(tmp_path):
    root = dvc_project(tmp_path / "proj", {"a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]}})
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect-home")}
    for args, message in [(["--targets", "nope"], "--targets: unknown stage(s) nope"),
                          (["--timeout", "trian=1"], "--timeout: unknown stage(s) trian"),
                          (["--timeout", "a=inf"], "got 'a=inf'"),
                          (["--timeout", "a=1e12"], "got 'a=1e12'"),
                          (["--retry-delay", "1e12"], "argument --retry-delay: expected a number >= 0 and at most"),
                          (["--retries", "-1"], "argument --retries: expected a number >= 0"),
                          (["--root", str(tmp_path / "missing")], "no such directory")]:
        r = subprocess.run([sys.executable, "-m", "flows.pipeline", *args], cwd=root, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stdout[-3000:], r.stderr[-3000:])
        assert r.stdout == "" and r.stderr.startswith("usage: "), "no flow started, no Prefect server"
        last = r.stderr.splitlines()[-1]
        assert last.startswith("python -m flows.pipeline: error: ") and message in last, (args, r.stderr[-3000:])


@pytest.mark.parametrize("module, flow, args", [("flows.pipeline", "pipeline", []),
                                               ("flows.retrain", "retrain", ["--once"])])
def test_sigterm_lets_the_cli_exit_through_its_clean_up(tmp_path, module, flow, args):
    """Prefect stops its temporary server from an exit handler; a SIGTERM that
    ended the process at once (Prefect re-sends it to the handler it found)
    leaked the server. The flow here is a stand-in that is sent SIGTERM."""
    root = dvc_project(tmp_path / "proj", {"a": {"cmd": "echo a > a.txt", "outs": ["a.txt"]}})
    script = textwrap.dedent(f"""
        import atexit, os, signal, sys, time
        import {module} as cli
        atexit.register(lambda: open("cleaned-up", "w").close())  # stands in for stopping the server
        def stand_in(**kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        cli.{flow} = stand_in
        sys.exit(cli.main({args!r}))
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 143, r.stderr[-3000:]
    assert (root / "cleaned-up").exists(), "SIGTERM skipped the exit handlers"


def test_parse_status_reads_what_dvc_did():
    assert runtime.parse_status(["Running stage 'pack':", "> python -m stages.pack"]) == "ran"
    assert runtime.parse_status(["Stage 'pack' is cached - skipping run, checking out outputs"]) == "restored"
    assert runtime.parse_status(["Stage 'pack' didn't change, skipping", "Data and pipelines are up to date."]) == "skipped"


def test_summary_lists_every_stage_with_its_status_and_metrics():
    stages = [StageInfo(n, "x") for n in ("ingest", "clean", "tokenizer", "pack")]
    results = [
        {"stage": "ingest", "status": "skipped", "seconds": 1.0, "metrics": {"docs": 10, "seconds": 3.0}},
        {"stage": "clean", "status": "restored", "seconds": 2.0, "metrics": {"kept": 9}},
        {"stage": "tokenizer", "status": "failed", "seconds": None, "metrics": {"vocab": 512}},  # an earlier run's
    ]
    md = runtime.summary_markdown(stages, results)
    head = md.splitlines()[0]
    assert head == ("**Failed: stage tokenizer** (1 not run after it); **0 of 4 stages ran**; "
                    "1 restored from DVC's run cache (clean)")
    assert "| ingest | skipped | 1.0 | docs=10 |" in md  # the stage's own seconds metric is not repeated
    assert "| clean | restored | 2.0 | kept=9 |" in md
    assert "| tokenizer | failed |  | - |" in md
    assert "| pack | not run |  | - |" in md

    done = [{"stage": s.name, "status": "skipped", "seconds": 0.5, "metrics": {}} for s in stages]
    assert runtime.summary_markdown(stages, done).startswith("**0 of 4 stages ran**: everything was up to date\n")
    done[1]["status"] = done[3]["status"] = "ran"
    assert runtime.summary_markdown(stages, done).startswith("**2 of 4 stages ran** (clean, pack)\n")


class FakeTracker:
    def __init__(self) -> None:
        self.metrics: dict = {}
        self.tags: dict = {}

    def log_params(self, params) -> None:
        pass

    def log_metrics(self, metrics) -> None:
        self.metrics.update(metrics)

    def set_tags(self, tags) -> None:
        self.tags.update(tags)

    def log_dict(self, data, name) -> None:
        pass


def test_a_failed_stage_is_given_with_its_own_error_line_under_the_headline():
    """The summary named the failed stage but not why: that was only in Prefect's tracebacks, printed twice."""
    dvc_tail = ("stage tokenizer: dvc repro exited with 255 after 2.1 s:\nRunning stage 'tokenizer':\n"
                "> python -m stages.tokenizer\nerror: stage tokenizer failed: data/clean/docs: no text to train on\n"
                "ERROR: failed to reproduce 'tokenizer': failed to run: python -m stages.tokenizer, exited with 2")
    assert runtime.failure_line(RuntimeError(dvc_tail)) == \
        "error: stage tokenizer failed: data/clean/docs: no text to train on"
    assert runtime.failure_line(RuntimeError(dvc_tail.replace("error: stage", "stage"))) == \
        "ERROR: failed to reproduce 'tokenizer': failed to run: python -m stages.tokenizer, exited with 2"
    assert runtime.failure_line(TimeoutError("Scope timed out after 3.0 second(s).\nmore")) == \
        "Scope timed out after 3.0 second(s)."
    assert runtime.failure_line(KeyboardInterrupt()) == "interrupted (Ctrl-C)"
    assert runtime.failure_line(SystemExit(143)) == "stopped (exit code 143)"
    assert runtime.failure_line(RuntimeError()) == "RuntimeError"

    stages = [StageInfo(n, "x") for n in ("clean", "tokenizer", "pack")]
    results = [{"stage": "clean", "status": "ran", "seconds": 1.0, "metrics": {}},
               {"stage": "tokenizer", "status": "failed", "seconds": None, "metrics": {},
                "error": "error: stage tokenizer failed: no text"}]
    lines = runtime.summary_markdown(stages, results).splitlines()
    assert lines[0].startswith("**Failed: stage tokenizer**")
    assert lines[1:4] == ["", "> tokenizer: error: stage tokenizer failed: no text", ""]
    assert lines[4] == "| stage | status | seconds | metrics |"

    tracker = FakeTracker()
    runtime.ParentRun(root=Path("/nonexistent"), uri="u", run_id="r", tracker=tracker).record(stages, results)
    assert tracker.tags["pipeline.error.tokenizer"] == "error: stage tokenizer failed: no text"
    assert not any(k.startswith("pipeline.error.") and k != "pipeline.error.tokenizer" for k in tracker.tags)


def test_parent_run_logs_metrics_only_of_stages_whose_outputs_are_current(tmp_path, monkeypatch):
    """A failed or not-run stage's metrics file and dvc.lock entry are an earlier
    run's: the parent run of a failed flow must not present them as this run's."""
    monkeypatch.setattr(runtime, "dvc_stage_hashes", lambda root: {n: f"h-{n}" for n in ("prep", "cached", "train",
                                                                                          "evaluate")})
    stages = [StageInfo(n, "x", metrics=(f"metrics/{n}.json",)) for n in ("prep", "cached", "train", "evaluate")]
    (tmp_path / "metrics").mkdir()
    for s in stages:
        (tmp_path / "metrics" / f"{s.name}.json").write_text('{"value": 1.5}')
    results = [{"stage": "prep", "status": "skipped", "seconds": 1.0},
               {"stage": "cached", "status": "restored", "seconds": 2.0},
               {"stage": "train", "status": "failed", "seconds": None}]
    tracker = FakeTracker()
    runtime.ParentRun(root=tmp_path, uri="u", run_id="r", tracker=tracker).record(stages, results)
    assert {k for k in tracker.metrics if not k.startswith("pipeline.")} == {"prep.value", "cached.value"}
    assert (tracker.metrics["pipeline.stages_ran"], tracker.metrics["pipeline.stages_restored"]) == (0, 1)
    assert tracker.tags["pipeline.status.train"] == "failed" and tracker.tags["pipeline.status.evaluate"] == "not_run"
    assert {k: v for k, v in tracker.tags.items() if k.startswith("dvc.stage_hash.")} == {
        "dvc.stage_hash.prep": "h-prep", "dvc.stage_hash.cached": "h-cached"}


def test_flow_runs_of_one_project_take_turns(tmp_path):
    import threading

    first, second = [], []
    started, done = threading.Event(), threading.Event()

    def later():
        started.set()
        with runtime.project_lock(tmp_path, second.append, "flow run 'b'"):
            done.set()

    with runtime.project_lock(tmp_path, first.append, "flow run 'a'"):
        assert f"flow run 'a' (pid {os.getpid()}, started " in (tmp_path / runtime.FLOW_LOCK).read_text()
        t = threading.Thread(target=later)
        t.start()
        started.wait(5)
        time.sleep(0.5)
        assert not done.is_set(), "the second run must wait for the first"
        assert second and second[0].startswith(f"waiting for flow run 'a' (pid {os.getpid()}, started ")
    t.join(10)
    assert done.is_set() and first == [] and "lock is free after" in second[1]
    with pytest.raises(KeyError):  # a run that fails lets the next one in
        with runtime.project_lock(tmp_path, first.append, "flow run 'c'"):
            raise KeyError
    with runtime.project_lock(tmp_path, first.append, "flow run 'd'"):
        with runtime.project_lock(tmp_path, first.append, "its subflow"):  # in the same thread: straight in
            assert "flow run 'd'" in (tmp_path / runtime.FLOW_LOCK).read_text()
        assert first == []


def test_child_env_makes_stage_runs_children_of_the_parent():
    env = runtime.ParentRun(root=Path("."), uri="sqlite:////x/mlflow.db", run_id="abc").child_env({"A": "1"})
    assert env == {"A": "1", "MLFLOW_PARENT_RUN_ID": "abc", "MLFLOW_TRACKING_URI": "sqlite:////x/mlflow.db"}
    # No parent (tracking off): an inherited id must not leak into the stages.
    env = runtime.ParentRun(root=Path("."), uri="u").child_env({"MLFLOW_PARENT_RUN_ID": "stale"})
    assert "MLFLOW_PARENT_RUN_ID" not in env


def test_no_password_of_a_uri_reaches_the_flow_log(tmp_path):
    """The flow logged ``MLflow parent run ... at $MLFLOW_TRACKING_URI`` as it was,
    password and all, and passed every line a stage printed (a source or remote
    URL with a token in it) on to Prefect's log, the summary and an MLflow tag."""
    run = runtime.ParentRun(root=tmp_path, uri="https://bob:hunter2@mlflow.example:5000", run_id="r1")
    assert run.describe() == "MLflow parent run r1 at https://bob:***@mlflow.example:5000"
    got: list[str] = []
    code, lines = runtime.stream_command(
        [sys.executable, "-c", "import sys; sys.exit('error: cannot fetch https://bob:hunter2@example.com/a.jsonl')"],
        tmp_path, dict(os.environ), got.append)
    assert code == 1 and got == lines == ["error: cannot fetch https://bob:***@example.com/a.jsonl"]


def test_interrupted_stage_takes_its_whole_process_group_down(tmp_path):
    """What a Prefect timeout does to a running stage: the exception lands in the
    wait loop, and every process of the stage dies, even one ignoring SIGTERM."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent("""
        import signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', flush=True); time.sleep(300)"])
        print(f"pids {child.pid}", flush=True)
        time.sleep(300)
    """))
    seen: list[str] = []

    def emit(line: str) -> None:
        seen.append(line)
        if line == "armed":
            raise KeyboardInterrupt  # stands in for Prefect's TaskRunTimeoutError

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        runtime.stream_command([sys.executable, str(script)], tmp_path, dict(os.environ), emit, kill_grace_s=1.0)
    child = int(next(line for line in seen if line.startswith("pids ")).split()[1])
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the stage's child survived the stop (it ignores SIGTERM: SIGKILL must follow)"
    assert time.monotonic() - t0 < 20


def test_a_second_ctrl_c_does_not_cut_the_stop_short(tmp_path):
    """A Ctrl-C while stop_group waits out its grace must not skip the SIGKILL:
    it is delivered once the group is gone."""
    (tmp_path / "stage.py").write_text(textwrap.dedent("""
        import os, signal, sys, time
        # Ignores SIGTERM, and answers it with the user's second Ctrl-C to the flow.
        signal.signal(signal.SIGTERM, lambda *_: os.kill(int(sys.argv[1]), signal.SIGINT))
        print("armed", flush=True)
        time.sleep(300)
    """))
    proc = subprocess.Popen([sys.executable, str(tmp_path / "stage.py"), str(os.getpid())], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert proc.stdout.readline().strip() == "armed"
        with pytest.raises(KeyboardInterrupt):
            runtime.stop_group(proc, grace_s=2)
        assert not alive(proc.pid), "the Ctrl-C cut stop_group short of its SIGKILL"
    finally:
        signal.signal(signal.SIGINT, previous)
        if alive(proc.pid):
            proc.kill()
        proc.wait()


def test_stage_dies_with_a_flow_process_killed_outright(tmp_path):
    """SIGKILL to the flow process (Prefect's runner after its grace, the OOM
    killer) runs none of its clean-up: the watchdog must stop the stage, even a
    stage that ignores SIGTERM."""
    (tmp_path / "stage.py").write_text(textwrap.dedent("""
        import os, signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(f"stage {os.getpid()}", flush=True)
        time.sleep(300)
    """))
    (tmp_path / "flow.py").write_text(textwrap.dedent("""
        import os, sys
        from flows import runtime
        runtime.stream_command([sys.executable, "stage.py"], ".", dict(os.environ), lambda line: print(line, flush=True),
                               kill_grace_s=1.0)
    """))
    flow = subprocess.Popen([sys.executable, "flow.py"], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    stage = None
    try:
        line = flow.stdout.readline()
        assert line.startswith("stage "), line
        stage = int(line.split()[1])
        flow.kill()
        flow.wait()
        deadline = time.monotonic() + 30
        while alive(stage) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(stage), "the stage outlived its flow process"
    finally:
        for pid in (flow.pid, stage):
            if pid is not None and alive(pid):
                os.kill(pid, 9)


def test_stream_command_returns_exit_code_and_lines_in_order(tmp_path):
    got: list[str] = []
    code, lines = runtime.stream_command(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        tmp_path, dict(os.environ), got.append)
    assert code == 3 and lines == got and set(lines) == {"out", "err"}


# --------------------------------------------------------------------------- the flow


FLAKY = """
    import os, pathlib, sys
    attempts = pathlib.Path("attempts-flaky")
    n = int(attempts.read_text()) + 1 if attempts.exists() else 1
    attempts.write_text(str(n))
    if n < 2:
        sys.exit("flaky: transient failure on attempt 1")
    pathlib.Path("data").mkdir(exist_ok=True)
    pathlib.Path("data/flaky.txt").write_text(os.environ.get("MLFLOW_PARENT_RUN_ID", ""))
    pathlib.Path("metrics").mkdir(exist_ok=True)
    pathlib.Path("metrics/flaky.json").write_text('{"attempts": %d}' % n)
"""
HANG = """
    import pathlib, subprocess, sys, time
    attempts = pathlib.Path("attempts-train")
    attempts.write_text(str(int(attempts.read_text()) + 1 if attempts.exists() else 1))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    import os
    pathlib.Path("pids").write_text(f"{os.getpid()} {child.pid}")
    print("training forever", flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_flow_retries_data_stage_times_out_training_stage_and_kills_it(tmp_path, shared):
    root = dvc_project(tmp_path / "proj", {
        "flaky": {"cmd": "python flaky.py", "deps": ["flaky.py"], "outs": ["data/flaky.txt"],
                  "metrics": [{"metrics/flaky.json": {"cache": False}}]},
        "train": {"cmd": "python hang.py", "deps": ["hang.py", "data/flaky.txt"], "outs": ["models/train.txt"]},
    }, {"flaky.py": FLAKY, "hang.py": HANG})
    env = flow_env(shared, "timeouts")
    t0 = time.monotonic()
    # flaky: the longest timeout accepted is one that Prefect can arm
    r = run_flow(root, env, "--retries", "1", "--retry-delay", "0", "--timeout", "train=3",
                 "--timeout", f"flaky={runtime.MAX_SECONDS:.0f}")
    elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stdout[-4000:]
    assert (root / "attempts-flaky").read_text() == "2", "the data stage is retried once"
    assert (root / "attempts-train").read_text() == "1", "the training stage is not retried"
    assert "exceeded timeout of 3" in r.stdout, r.stdout[-4000:]
    assert "| flaky | ran |" in r.stdout and "| train | failed |" in r.stdout
    assert "\n> train: Scope timed out after 3.0 second(s)" in r.stdout, r.stdout[-4000:]  # why, under the headline
    for pid in map(int, (root / "pids").read_text().split()):
        assert not alive(pid), f"process {pid} of the timed-out stage is still running"
    assert elapsed < 200

    [parent] = [run for run in mlflow_runs(shared["MLFLOW_TRACKING_URI"], "timeouts") if run.info.run_name == "pipeline"]
    assert parent.info.status == "FAILED"
    assert (root / "data" / "flaky.txt").read_text() == parent.info.run_id, "stages get MLFLOW_PARENT_RUN_ID"
    assert parent.data.tags["pipeline.status.flaky"] == "ran"
    assert parent.data.tags["pipeline.status.train"] == "failed"
    assert parent.data.tags["pipeline.error.train"] == "Scope timed out after 3.0 second(s)."
    assert parent.data.metrics["flaky.attempts"] == 2


FAILS = """
    import sys
    print("loading the config", flush=True)
    sys.exit("error: stage bad failed: bad.lr must be > 0, got -1")
"""


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_failing_stage_ends_the_flow_failed_with_its_one_line_error_not_tracebacks(tmp_path, shared):
    """A stage that failed was logged as Prefect's traceback of StageFailed, its
    40-line output tail and all, once by the task and once more by the flow."""
    root = dvc_project(tmp_path / "proj", {
        "ok": {"cmd": "cp in.txt ok.txt", "deps": ["in.txt"], "outs": ["ok.txt"]},
        "bad": {"cmd": "python bad.py", "deps": ["bad.py", "ok.txt"], "outs": ["bad.txt"]},
        "after": {"cmd": "cp bad.txt after.txt", "deps": ["bad.txt"], "outs": ["after.txt"]},
    }, {"in.txt": "x\n", "bad.py": FAILS})
    r = run_flow(root, flow_env(shared, "failing-stage"), "--retries", "1", "--retry-delay", "0",
                 "--retry-stages", "bad")
    assert r.returncode == 1, r.stdout[-4000:]
    assert "Traceback" not in r.stdout, r.stdout[-6000:]
    assert r.stdout.count("loading the config") == 2, "the stage was retried once"
    why = "error: stage bad failed: bad.lr must be > 0, got -1"
    assert f"Finished in state Failed('stage bad: {why}')" in r.stdout, r.stdout[-4000:]
    assert f"\n> bad: {why}\n" in r.stdout and "| ok | ran |" in r.stdout and "| after | not run |" in r.stdout
    [parent] = [run for run in mlflow_runs(shared["MLFLOW_TRACKING_URI"], "failing-stage")
                if run.info.run_name == "pipeline"]
    assert parent.info.status == "FAILED"
    assert parent.data.tags["pipeline.error.bad"] == why and parent.data.tags["pipeline.status.after"] == "not_run"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_at_the_terminal_stops_the_stage_and_the_flow_still_reports(tmp_path, shared):
    """A terminal's Ctrl-C reaches the whole foreground process group, Prefect's
    temporary server included. It used to kill the server while the flow stopped
    the stage: the flow then hung for minutes on the dead API, and never printed
    its summary or logged the stage statuses to MLflow."""
    root = dvc_project(tmp_path / "proj", {
        "train": {"cmd": "python hang.py", "deps": ["hang.py"], "outs": ["models/train.txt"]},
    }, {"hang.py": HANG})
    env = flow_env(shared, "ctrl-c")
    # As a shell starts it in a terminal: a process group of its own, Ctrl-C not ignored.
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline"], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    try:
        read_until_the_stage_runs(proc, seen)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does
        out = "".join(seen) + proc.communicate(timeout=150)[0]  # it hung here for minutes
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0
    assert "**Failed: stage train**" in out and "| train | failed |" in out, out[-4000:]
    assert "\n> train: interrupted (Ctrl-C)\n" in out, out[-4000:]
    assert "artifact was not saved" not in out, "the temporary server died with the Ctrl-C"
    for pid in map(int, (root / "pids").read_text().split()):
        assert not alive(pid), f"process {pid} of the interrupted stage is still running"
    [parent] = [run for run in mlflow_runs(shared["MLFLOW_TRACKING_URI"], "ctrl-c") if run.info.run_name == "pipeline"]
    assert parent.data.tags["pipeline.status.train"] == "failed"


def read_until_the_stage_runs(proc: subprocess.Popen, seen: list[str]) -> None:
    """Read the flow's output into ``seen`` until its hanging stage says it runs."""
    for line in proc.stdout:
        seen.append(line)
        if "training forever" in line:
            return
    raise AssertionError("the stage never started:\n" + "".join(seen[-40:]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_flow_stops_its_stage_and_its_temporary_server(tmp_path, shared):
    """``kill PID`` of a running ``python -m flows.pipeline`` (a service manager,
    a CI job's cancel): the stage's processes and Prefect's temporary server must
    not outlive it, and the flow still reports."""
    import socket

    root = dvc_project(tmp_path / "proj", {
        "train": {"cmd": "python hang.py", "deps": ["hang.py"], "outs": ["models/train.txt"]},
    }, {"hang.py": HANG})
    proc = subprocess.Popen([sys.executable, "-m", "flows.pipeline"], cwd=root, env=flow_env(shared, "sigterm"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    try:
        read_until_the_stage_runs(proc, seen)
        proc.send_signal(signal.SIGTERM)  # the flow process alone, not its group
        out = "".join(seen) + proc.communicate(timeout=150)[0]
        assert proc.returncode != 0
        assert "| train | failed |" in out, out[-4000:]
        for pid in map(int, (root / "pids").read_text().split()):
            assert not alive(pid), f"process {pid} of the stopped stage is still running"
        [port] = re.findall(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", out)
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(port))) != 0, "the temporary Prefect server outlived the flow"
    finally:  # what a failure left behind: the flow, its stage, its server (each in a process group of its own)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ports = re.findall(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", "".join(seen))
        left = list(map(int, (root / "pids").read_text().split())) if (root / "pids").exists() else []
        left += [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and ports
                 and "uvicorn\0" in _cmdline(p) and f"--port\0{ports[0]}\0" in _cmdline(p)]
        for pid in left:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _cmdline(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_text(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_data_stages_run_once_then_the_second_run_is_a_noop(tmp_path, shared):
    root = project_copy(tmp_path / "proj", TINY)
    env = flow_env(shared, "noop")

    first = run_flow(root, env, "--targets", "pack")
    assert first.returncode == 0, first.stdout[-5000:]
    assert statuses(first.stdout) == {s: "ran" for s in DATA_STAGES}
    assert not {k: v for k, v in runtime.changed_stages(root).items() if k in DATA_STAGES}, "DVC: all up to date"
    lock = (root / "dvc.lock").read_bytes()
    mtimes = {p: p.stat().st_mtime_ns for s in DATA_STAGES for p in (root / "metrics").glob(f"{s}.json")}
    assert len(mtimes) == len(DATA_STAGES)

    second = run_flow_behind_a_held_lock(root, env, "--targets", "pack")
    assert second.returncode == 0, second.stdout[-5000:]
    assert statuses(second.stdout) == {s: "skipped" for s in DATA_STAGES}
    assert "**0 of 4 stages ran**" in second.stdout
    assert (root / "dvc.lock").read_bytes() == lock
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes, "no stage rewrote its outputs"

    # MLflow: one parent per flow run; the stages that ran are its children.
    runs = mlflow_runs(shared["MLFLOW_TRACKING_URI"], "noop")
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 2 and all(p.info.status == "FINISHED" for p in parents)
    p1, p2 = parents
    hashes = lineage_hashes(root)
    for p in (p1, p2):
        for s in DATA_STAGES:
            assert p.data.tags[f"dvc.stage_hash.{s}"] == hashes[s]
        assert p.data.params["ingest.max_bytes"] == "300000" and p.data.params["tokenizer.vocab_size"] == "512"
        assert p.data.tags.get("mlflow.source.git.commit"), "the project's commit is recorded"
    assert p1.data.metrics["pipeline.stages_ran"] == 4 and p2.data.metrics["pipeline.stages_ran"] == 0
    assert set(p1.data.metrics) == set(p2.data.metrics), "metric names are the same across runs"
    assert any(k.startswith("pack.") for k in p1.data.metrics)

    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == p1.info.run_id]
    assert sorted(r.info.run_name for r in children) == sorted(DATA_STAGES)
    for c in children:
        assert c.data.tags.get("dvc.stage_hash") == hashes[c.info.run_name], "child and parent agree on lineage"
    assert not [r for r in runs if r.data.tags.get("mlflow.parentRunId") == p2.info.run_id], \
        "a no-op run starts no stage runs"


def lineage_hashes(root: Path) -> dict[str, str]:
    from pipeline.tracking.tracker import dvc_stage_hashes

    return dvc_stage_hashes(root)


# --------------------------------------------------------------------------- DVC's view of a params edit


def _placeholder(path: Path, is_dir: bool) -> None:
    if path.exists():
        return
    if is_dir:
        path.mkdir(parents=True)
        (path / "placeholder").write_text("x")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}" if path.suffix == ".json" else "x\n")


def _changed_value(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if value is None:
        return 1
    return f"{value}-edited"


def _first_leaf(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            found = _first_leaf(v, (*path, k))
            if found is not None:
                return found
        return None
    if isinstance(node, list):
        return None
    return path


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_editing_only_evaluate_params_makes_dvc_rerun_only_evaluate_and_descendants(tmp_path):
    spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    if "evaluate" not in spec:
        pytest.skip("dvc.yaml has no 'evaluate' stage yet")
    root = project_copy(tmp_path / "proj")
    stages = lineage.load_stages(root)
    # Stand-in outputs for every stage, recorded in dvc.lock with `dvc commit`: the
    # whole pipeline is then up to date without running any of it.
    deps = {d for s in stages for d in s.deps}
    for s in stages:
        for out in s.outs:
            _placeholder(root / out, is_dir=not Path(out).suffix or any(d.startswith(out + "/") for d in deps))
        for m in s.metrics:
            _placeholder(root / m, is_dir=False)
    for d in deps:
        _placeholder(root / d, is_dir=not Path(d).suffix)
    for s in stages:  # plots are outputs too
        for p in spec.get(s.name, {}).get("plots", []):
            _placeholder(root / (next(iter(p)) if isinstance(p, dict) else p), is_dir=False)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([str(BIN / "dvc"), "commit", "-f", "-q"], cwd=root, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert runtime.changed_stages(root) == {}, "baseline: DVC sees everything up to date"

    params = yaml.safe_load((root / "params.yaml").read_text())
    tracked = next(p for p in spec["evaluate"]["params"] if isinstance(p, str))  # "evaluate" or "evaluate.key"
    node_path = tuple(tracked.split("."))
    node = params
    for k in node_path:
        node = node[k]
    leaf = node_path + (_first_leaf(node) or ())
    parent = params
    for k in leaf[:-1]:
        parent = parent[k]
    parent[leaf[-1]] = _changed_value(parent[leaf[-1]])
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    changed = set(runtime.changed_stages(root))
    allowed = {"evaluate"} | lineage.descendants(stages, "evaluate")
    assert "evaluate" in changed, f"editing {'.'.join(leaf)} did not make evaluate stale"
    assert changed <= allowed, f"editing {'.'.join(leaf)} also invalidated {sorted(changed - allowed)}"
