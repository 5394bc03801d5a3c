"""An expected stage failure is one line on stderr, ``error: stage <name> failed:
<message>``, and exit code 2: no traceback. Each case runs the real stage module
in an empty folder, so its inputs are missing (or its params are wrong)."""

import contextlib
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from pipeline.errors import StageError
from pipeline.runner import one_line
from tests.conftest import ROOT
from tests.helpers import on_small_disk, small_disks

CASES = {
    # stage, params.yaml text (None: the shipped one), what the message must name
    "pack-before-tokenizer": ("pack", None, "data/tokenizer/tokenizer.json"),
    "evaluate-without-models": ("evaluate", None, "data/tokenizer/tokenizer.json"),
    "export-before-evaluate": ("export", None, "metrics/evaluate.json not found; run `dvc repro evaluate` first"),
    "clean-bad-params": ("clean", "clean:\n  num_workers: -1\n  bogus: 1\n", "clean.num_workers"),
    "sft-bad-params": ("sft", "sft:\n  bogus: 1\n", "sft.bogus: unknown key"),  # a training stage's launcher
}


def run_stage_module(stage: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_TRACKING": "0"}
    return subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_expected_failure_is_one_line_and_exit_2(case, tmp_path):
    stage, params, named = CASES[case]
    (tmp_path / "params.yaml").write_text(params if params is not None else (ROOT / "params.yaml").read_text())
    r = run_stage_module(stage, tmp_path)
    lines = r.stderr.splitlines()
    assert "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: stage {stage} failed: ") and named in lines[0], lines[0]
    assert r.returncode == 2


@pytest.mark.parametrize("read_only", [False, True], ids=["full", "read-only"])
def test_a_data_stage_on_a_full_or_read_only_disk_is_one_line_naming_the_file(tmp_path, read_only):
    """ingest's first shard does not fit on a 64 kB filesystem (a real tmpfs), or
    cannot be written at all."""
    if small_disks():
        pytest.skip(small_disks())
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "data" / "ingest").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PIPELINE_TRACKING": "0"}
    r = subprocess.run(on_small_disk("data/ingest", 64, f"exec {sys.executable} -m stages.ingest", read_only),
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = r.stderr.splitlines()
    if read_only:
        assert line == "error: stage ingest failed: read-only file system: data/ingest/docs (EROFS)"
        return
    assert re.fullmatch(
        r"error: stage ingest failed: no space left on the device writing data/ingest/docs/shard-00000\.parquet "
        rf"\(\d+ kB free on {re.escape(str(tmp_path / 'data' / 'ingest'))}\); free some space and run the stage "
        r"again", line), line


FULL = '''
import errno

from pipeline.runner import run_stage, run_training_stage


def body(cfg):  # a write outside the atomic helpers: the OS's error names the file
    raise OSError({errno}, "{strerror}", "data/clean/quarantine.jsonl")


if __name__ == "__main__":
    if {training}:
        run_training_stage("pretrain", "full", "models/pretrain", body)
    else:
        run_stage("clean", body)
'''


@pytest.mark.parametrize("refusal", ["ENOSPC", "EACCES"])
@pytest.mark.parametrize("training", [False, True], ids=["data-stage", "training-rank"])
def test_a_write_the_os_refuses_anywhere_in_a_stage_is_one_line(tmp_path, training, refusal):
    """A full disk, or a permission: the user's to fix, so no traceback."""
    strerror = {"ENOSPC": "No space left on device", "EACCES": "Permission denied"}[refusal]
    (tmp_path / "full.py").write_text(FULL.format(training=training, errno=f"errno.{refusal}", strerror=strerror))
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path))), "PIPELINE_TRACKING": "0"}
    if training:  # as a rank: the stage's body runs in this process
        env.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    r = subprocess.run([sys.executable, "-m", "full"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    [line] = [line for line in r.stderr.splitlines() if "error" in line.lower() or "Traceback" in line]
    who = "stage pretrain (rank 0)" if training else "stage clean"
    if refusal == "EACCES":
        assert line == f"error: {who} failed: permission denied: data/clean/quarantine.jsonl (EACCES)"
        return
    assert re.fullmatch(rf"error: {re.escape(who)} failed: no space left on the device writing data/clean/quarantine\.jsonl "
                        r"\([\d,.]+ [kMG]B free on /\S*\); free some space and run the stage again", line), line


PEER = '''
from pipeline.runner import run_training_stage


def body(cfg):
    raise RuntimeError({message!r})


if __name__ == "__main__":
    run_training_stage("pretrain", "peer", "models/pretrain", body)
'''


@pytest.mark.parametrize("message", [
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:24754. This is "
    "typically caused by a remote worker crashing.", "a bug"], ids=["peer-lost", "bug"])
def test_a_rank_whose_collective_lost_its_peer_says_so_in_one_line(tmp_path, message):
    """On several nodes the agent does not watch the other node's ranks: a rank
    whose peer there died is not stopped during the grace, and says why it fails."""
    (tmp_path / "peer.py").write_text(PEER.format(message=message))
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path))), "PIPELINE_TRACKING": "0",
           "LOCAL_RANK": "0", "RANK": "1", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "-m", "peer"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    if message == "a bug":  # keeps its traceback
        assert r.returncode == 1 and r.stderr.splitlines()[-1] == "RuntimeError: a bug", r.stderr[-3000:]
        return
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        "error: stage pretrain (rank 1) failed: a collective lost a peer rank (it stopped, or its node failed or "
        f"left; its own node's line says why): RuntimeError: {message}"]


def test_every_stage_error_class_is_a_stage_error():
    from pipeline.config import ConfigError
    from pipeline.data.clean import CleanError
    from pipeline.data.ingest import IngestError
    from pipeline.data.pack import PackError
    from pipeline.data.shards import DataError
    from pipeline.data.tokenizer import TokenizerError
    from pipeline.evaluate import EvaluateError
    from pipeline.export import ExportError

    for cls in (ConfigError, CleanError, IngestError, PackError, DataError, TokenizerError, EvaluateError,
                ExportError):
        assert issubclass(cls, StageError), cls.__name__
    assert issubclass(ConfigError, ValueError)  # callers that catch ValueError keep working


def test_one_line_joins_a_config_error_list():
    msg = "params.yaml is invalid:\n  pack.seq_len: too small\n  pack.bogus: unknown key"
    assert one_line(msg) == "params.yaml is invalid: pack.seq_len: too small; pack.bogus: unknown key"
    assert one_line("first\n\n   \nsecond\n") == "first; second"  # blank lines add no empty part


def test_a_bug_in_a_stage_keeps_its_traceback_and_writes_no_metrics(tmp_path, monkeypatch):
    """Only expected failures become one line and exit 2; anything else is a bug and is raised as it was."""
    from pipeline.runner import run_stage

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("evaluate: {}\n")

    def body(cfg):
        raise ZeroDivisionError("a bug")

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(ZeroDivisionError, match="a bug"):
        run_stage("evaluate", body)
    assert not (tmp_path / "metrics").exists()
    assert signal.getsignal(signal.SIGTERM) == before  # the stage's handler does not outlive it


@pytest.mark.parametrize("flag, shown", [("", False), ("0", False), ("off", False), ("1", True), ("yes", True)])
def test_an_expected_failure_shows_its_traceback_only_under_pipeline_debug(tmp_path, monkeypatch, capsys, flag, shown):
    from pipeline.runner import run_stage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_DEBUG", flag)

    def body(cfg):
        raise StageError("data/clean/input.parquet is bad")

    for params, line in (("evaluate: {}\n", "error: stage evaluate failed: data/clean/input.parquet is bad"),
                         ("evaluate: {bogus: 1}\n", "error: stage evaluate failed: params.yaml is invalid: "
                          "evaluate.bogus: unknown key (check the spelling; see README 'Params reference')")):
        (tmp_path / "params.yaml").write_text(params)
        with pytest.raises(SystemExit) as exit_:
            run_stage("evaluate", body)
        err = capsys.readouterr().err.splitlines()
        assert exit_.value.code == 2 and err[-1] == line, err
        assert ("Traceback (most recent call last):" in err) is shown, err
        raised = ("pipeline.errors.StageError: data/clean/input.parquet is bad",
                  "pipeline.config.ConfigError: params.yaml is invalid:")
        assert len(err) == 1 or any(e.startswith(raised) for e in err)


def test_only_a_collective_s_error_is_a_lost_peer_or_a_timeout():
    """A socket error of the rank's own (MLflow's HTTP, a remote read) saying the same words is no lost peer."""
    from pipeline.runner import peer_lost, timed_out

    assert peer_lost(RuntimeError("[gloo/transport] Connection reset by peer"))
    assert not peer_lost(ConnectionResetError(104, "Connection reset by peer"))
    assert timed_out(RuntimeError("Timed out waiting 4000ms for send operation"))
    assert not timed_out(TimeoutError("Timed out waiting for the MLflow server"))


STAND_IN = '''
import time

from pipeline.data.executor import open_executor
from pipeline.runner import run_stage


def task(i):
    return i


def feed():  # slower than the workers, which wait for tasks most of the time
    for i in range(100000):
        time.sleep(0.05)
        yield (i,)


def body(cfg):
    with open_executor(cfg.executor, desc="stand-in", max_workers=2) as ex:
        for i in ex.map(task, feed()):
            if i == 4:
                print("working", flush=True)
    return {}


if __name__ == "__main__":
    run_stage("clean", body)
'''


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_data_stage_stopped_by_a_signal_is_one_line_and_its_mlflow_run_is_killed(tmp_path, sig):
    """A stand-in for a data stage: ``run_stage`` with clean's params and a pool
    of 2 workers, waiting for tasks most of the time. Ctrl-C reaches the whole
    process group (the workers too), as a terminal sends it; SIGTERM the stage
    process alone."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    (tmp_path / "params.yaml").write_text("clean:\n  executor: {kind: local, num_workers: 2}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path))), "PIPELINE_TRACKING": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PIPELINE_PROGRESS": "0"}
    # As from a terminal: SIGINT at its default, so that Python raises KeyboardInterrupt
    # (a shell that starts a job in the background, `make test &`, ignores it for the job).
    proc = subprocess.Popen([sys.executable, "-m", "stand_in"], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.readline() == "working\n"
        workers = psutil.Process(proc.pid).children(recursive=True)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert [line for line in err.splitlines() if "error" in line.lower() or "Traceback" in line] == [
        f"error: stage clean stopped by {sig.name}"], err[-3000:]
    assert not psutil.wait_procs(workers, timeout=10)[1], "a worker outlived the stage"
    import mlflow

    runs = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [e.experiment_id for e in mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("clean", "KILLED")]


FAILING_STAND_IN = '''
from pipeline.errors import StageError
from pipeline.runner import run_stage


def body(cfg):
    raise StageError("data/clean/input.parquet is bad")


if __name__ == "__main__":
    run_stage("clean", body)
'''


def run_tracked_stand_in(tmp_path, name: str, source: str):
    """Run ``source`` as module ``name`` in ``tmp_path`` with tracking into a
    SQLite MLflow store there; its process result and the one MLflow run."""
    import mlflow

    (tmp_path / f"{name}.py").write_text(source)
    (tmp_path / "params.yaml").write_text("clean: {}\n")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join((str(ROOT), str(tmp_path))), "PIPELINE_TRACKING": "1",
           "MLFLOW_TRACKING_URI": uri, "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false", "PIPELINE_PROGRESS": "0"}
    r = subprocess.run([sys.executable, "-m", name], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    client = mlflow.MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, (runs, r.stderr[-3000:])
    return r, client, runs[0]


def test_an_expected_failure_ends_the_stage_s_mlflow_run_failed_with_the_error(tmp_path):
    r, _, run = run_tracked_stand_in(tmp_path, "failing_stand_in", FAILING_STAND_IN)
    assert r.returncode == 2 and r.stderr.splitlines()[-1] == (
        "error: stage clean failed: data/clean/input.parquet is bad"), r.stderr[-3000:]
    assert (run.info.run_name, run.info.status) == ("clean", "FAILED")
    assert run.data.tags["error"] == "data/clean/input.parquet is bad"


PASSING_STAND_IN = '''
from pathlib import Path

from pipeline.files import write_json
from pipeline.runner import run_stage

REPORT = Path("data/clean/report.json")


def body(cfg):
    write_json(REPORT, {"per_reason": {}})
    return {"docs": 3}


if __name__ == "__main__":
    run_stage("clean", body, artifacts=(REPORT,))
'''


def test_a_stage_s_metrics_file_and_mlflow_run_carry_its_metrics_seconds_and_report(tmp_path):
    from pipeline.files import read_json

    r, client, run = run_tracked_stand_in(tmp_path, "passing_stand_in", PASSING_STAND_IN)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = read_json(tmp_path / "metrics" / "clean.json")
    assert metrics["docs"] == 3 and metrics["seconds"] >= 0
    assert (run.info.run_name, run.info.status, run.data.metrics["docs"]) == ("clean", "FINISHED", 3)
    assert run.data.params["clean.executor.kind"] == "local"  # the stage's params, under its name
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["report.json"]


@pytest.mark.parametrize("code, why, line, ended", [
    (0, None, None, None),
    (2, None, None, "FAILED"),  # a rank's StageError: it printed its own one line
    (1, None, "error: stage pretrain failed (exit code 1); see the rank's message above", "FAILED"),
    (-9, "rank 0 was killed by SIGKILL", "error: stage pretrain failed: rank 0 was killed by SIGKILL; ", "FAILED"),
    (143, "stopped by SIGTERM", "error: stage pretrain stopped by SIGTERM; ", "KILLED"),
], ids=["ok", "rank-stage-error", "rank-bug", "rank-killed", "stopped"])
def test_the_launcher_adds_one_line_only_where_no_rank_spoke_and_exits_with_the_agent_s_code(
        tmp_path, monkeypatch, capsys, code, why, line, ended):
    """Outside torchrun (as DVC runs a training stage) the launcher's own line and exit code, without torchrun."""
    from pipeline import runner
    from pipeline.training import torchrun

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text("pretrain: {}\n")
    for var in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torchrun, "launch", lambda module, cfg, folder, before=None: (code, why))
    ended_as = []
    monkeypatch.setattr(runner, "end_launch_runs", lambda launch_id, status: ended_as.append(status))
    with pytest.raises(SystemExit) as exit_:
        runner.run_training_stage("pretrain", "no.such.module", tmp_path / "models", lambda cfg: {})
    assert exit_.value.code == code
    err = capsys.readouterr().err.splitlines()
    if line is None:
        assert err == []
    else:
        assert len(err) == 1 and err[0].startswith(line), err
    assert ended_as == ([] if ended is None else [ended])


@pytest.fixture
def as_rank(tmp_path, monkeypatch):
    """``as_rank(rank, world, timeout_s)``: this process as that rank inside
    torchrun (no agent, no MLflow), in ``tmp_path``, without the grace wait of a
    failing rank; runs ``body`` through run_training_stage and gives the exit
    code (None: it returned)."""
    from pipeline import runner

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PIPELINE_LAUNCHED", raising=False)
    monkeypatch.setattr(runner, "PEER_FAILURE_GRACE_S", 0)

    def run(body, rank=0, world=1, timeout_s="null"):
        (tmp_path / "params.yaml").write_text(f"pretrain:\n  launch: {{timeout_s: {timeout_s}}}\n"
                                              "  logging: {track: false}\n")
        for var, value in (("LOCAL_RANK", rank), ("RANK", rank), ("WORLD_SIZE", world)):
            monkeypatch.setenv(var, str(value))
        try:
            runner.run_training_stage("pretrain", "no.such.module", tmp_path / "models", body)
        except SystemExit as e:
            return e.code
        return None

    return run


@pytest.mark.parametrize("timeout_s, waited", [("4", "4 s"), ("null", "torch's default (NCCL 600 s, gloo 1800 s)")])
def test_a_rank_whose_collective_timed_out_names_the_setting_to_raise(as_rank, capsys, timeout_s, waited):
    def body(cfg):
        raise RuntimeError("[gloo] Timed out waiting 4000ms for send operation to complete")

    assert as_rank(body, rank=1, world=2, timeout_s=timeout_s) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: stage pretrain (rank 1) failed: a collective waited more than {waited} (launch.timeout_s) for another "
        "rank, which stalled or was cut off: RuntimeError: [gloo] Timed out waiting 4000ms for send operation to "
        "complete; if a rank was only busy (writing a checkpoint alone, compiling), raise launch.timeout_s"]


def test_on_one_rank_a_timeout_s_words_are_a_bug_s_and_keep_the_traceback(as_rank):
    def body(cfg):
        raise RuntimeError("Timed out waiting for the MLflow server")

    with pytest.raises(RuntimeError, match="MLflow server"):
        as_rank(body, rank=0, world=1)


def test_a_non_finite_loss_stops_the_rank_with_exit_code_3_in_one_line(as_rank, capsys):
    from pipeline.training.trainer import NonFiniteError

    def body(cfg):
        raise NonFiniteError("non-finite loss (nan) at step 7")

    assert as_rank(body, rank=1, world=2) == 3
    assert capsys.readouterr().err.splitlines() == [
        "error: stage pretrain (rank 1) stopped: non-finite loss (nan) at step 7"]


def test_only_rank_0_writes_the_stage_s_metrics(as_rank, tmp_path):
    from pipeline.files import read_json

    assert as_rank(lambda cfg: {"steps": 3}, rank=1, world=2) is None
    assert not (tmp_path / "metrics").exists()
    assert as_rank(lambda cfg: {"steps": 3}, rank=0, world=2) is None
    metrics = read_json(tmp_path / "metrics" / "pretrain.json")
    assert metrics["steps"] == 3 and metrics["seconds"] >= 0
