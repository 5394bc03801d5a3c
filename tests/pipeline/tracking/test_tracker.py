"""pipeline/tracking/tracker.py: rank-0 MLflow logging, batching, DVC/git tags, and the
outage path; pipeline/tracking/lineage.py: DVC's stage hashes. Every MLflow store
here is a SQLite file under tmp; the repo's mlflow.db is never touched
(PIPELINE_ROOT points into tmp for every test)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.tracking import tracker as tracking
from pipeline.tracking.tracker import (
    Tracker,
    TrackingOfflineWarning,
    artifact_location,
    current_stage_fingerprint,
    dvc_stage_hashes,
    offline_uri,
    replay_offline,
    server_command,
    tracking_uri,
)
from tests.conftest import ROOT

BIN = Path(sys.executable).parent

ENV_VARS = (
    "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_PARENT_RUN_ID", "MLFLOW_RUN_ID",
    "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
    "PIPELINE_ROOT", "PIPELINE_TRACKING", "RANK",
    "DVC_ROOT", "DVC_STAGE", "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV",
    *tracking.HTTP_DEFAULTS,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path, request):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path))
    # One experiment per test keeps the shared database's runs apart.
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"test-{request.node.name}")


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    """A SQLite store shared by the module: creating its tables takes ~2.4 s."""
    from mlflow import MlflowClient

    folder = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()
    return folder, uri


@pytest.fixture
def client(db, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    return MlflowClient(db[1])


@pytest.fixture
def git_repo(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text("print('hi')\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=repo, check=True)
    monkeypatch.chdir(repo)
    return repo


@pytest.fixture
def batch_calls(monkeypatch):
    """Count MlflowClient.log_batch and log_metric calls while passing them through."""
    from mlflow import MlflowClient

    calls = {"log_batch": 0, "log_metric": 0}
    for name in calls:
        original = getattr(MlflowClient, name)

        def spy(self, *args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(MlflowClient, name, spy)
    return calls


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_warnings(caught) -> list:
    return [w for w in caught if issubclass(w.category, TrackingOfflineWarning)]


def offline_run(tracker):
    """The client of a tracker's offline store, and the one run in it."""
    from mlflow import MlflowClient

    local = MlflowClient(offline_uri(tracker.offline_path))
    (run,) = local.search_runs([e.experiment_id for e in local.search_experiments()])
    return local, run


# --------------------------------------------------------------------------- import, locations


def test_import_is_cheap_and_does_not_import_mlflow():
    code = (
        "import sys, time\n"
        "t = time.perf_counter()\n"
        "import pipeline.tracking.tracker\n"
        "print(time.perf_counter() - t)\n"
        "print(','.join(m for m in ('mlflow', 'dvc', 'pydantic') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    seconds, heavy = out.stdout.splitlines()
    assert heavy == ""
    assert float(seconds) < 0.3


def test_locations_default_to_project_root_and_env_wins(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPELINE_ROOT")
    monkeypatch.chdir(tmp_path)
    assert tracking_uri() == f"sqlite:///{tmp_path}/mlflow.db"
    assert artifact_location() == f"file://{tmp_path}/mlartifacts"

    # dvc exp run --temp: the stage runs in a copy, DVC_ROOT names the real repo.
    repo = tmp_path / "repo"
    monkeypatch.setenv("DVC_ROOT", str(repo))
    assert tracking_uri() == f"sqlite:///{repo}/mlflow.db"
    assert artifact_location() == f"file://{repo}/mlartifacts"
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path / "p"))
    assert tracking_uri() == f"sqlite:///{tmp_path}/p/mlflow.db"

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri() == "http://127.0.0.1:5000"
    assert artifact_location() == f"file://{tmp_path}/p/mlartifacts"  # a local server shares our disk
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    assert artifact_location() is None  # a remote server decides
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/x/other.db")
    assert artifact_location() == f"file://{tmp_path}/x/mlartifacts"


def test_server_command_matches_make_mlflow(tmp_path):
    argv, env = server_command(5001, root=tmp_path)
    assert argv[argv.index("--backend-store-uri") + 1] == f"sqlite:///{tmp_path}/mlflow.db"
    assert argv[argv.index("--artifacts-destination") + 1] == f"{tmp_path}/mlartifacts"
    assert argv[argv.index("--workers") + 1] == "1" and env == {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    makefile = ROOT / "Makefile"
    if makefile.exists():  # the UI must read the same database and folder we write
        text = makefile.read_text()
        assert "sqlite:///$(abspath mlflow.db)" in text
        assert "--artifacts-destination $(abspath mlartifacts)" in text


# --------------------------------------------------------------------------- online


def test_params_are_flattened_truncated_and_batched(client, batch_calls):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH
    from pydantic import BaseModel

    class Model(BaseModel):
        n_layer: int = 4
        betas: list[float] = [0.9, 0.95]

    class Cfg(BaseModel):
        model: Model = Model()
        note: str = "x" * 7000

    wide = {f"k{i:03d}": i for i in range(150)}  # more than one log_batch may carry
    with Tracker("pretrain", system_metrics=False) as t:
        t.log_params(Cfg(), prefix="pretrain")
        t.log_params({"world_size": 2, "precision": "bf16", "bad key!": 1, "opt": {"lr": 3e-4}})
        t.log_params(wide)
    params = client.get_run(t.run_id).data.params
    assert params["pretrain.model.n_layer"] == "4"
    assert params["pretrain.model.betas"] == "[0.9, 0.95]"
    assert params["pretrain.note"] == "x" * MAX_PARAM_VAL_LENGTH  # cut to MLflow's limit, not an error
    assert params["world_size"] == "2" and params["precision"] == "bf16"
    assert params["opt.lr"] == "0.0003" and params["bad key_"] == "1"
    assert all(params[k] == str(v) for k, v in wide.items())
    # one batch per log_params call (MLflow splits the 150-wide one to its request limit); end adds none
    assert batch_calls["log_batch"] == 3


def test_conflicting_param_is_skipped_not_fatal(client):
    with Tracker("pretrain", system_metrics=False) as t:
        t.log_params({"lr": 0.1})
        with pytest.warns(tracking.TrackingWarning, match="lr"):
            t.log_params({"lr": 0.2})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            t.log_params({"lr": 0.1})  # what is logged already: no warning
    assert client.get_run(t.run_id).data.params["lr"] == "0.1"
    assert client.get_run(t.run_id).info.status == "FINISHED"


def test_metrics_are_buffered_and_sent_in_few_batches(client, batch_calls):
    with Tracker("pretrain", system_metrics=False, flush_every_n=1000, flush_every_s=3600) as t:
        for step in range(600):
            t.log_metrics({"loss": 10.0 / (step + 1), "lr": 1e-3}, step=step)
        assert batch_calls["log_batch"] == 1  # 1200 records: one flush at 1000
    assert batch_calls["log_batch"] == 2  # the last 200 at the end
    assert batch_calls["log_metric"] == 0
    history = client.get_metric_history(t.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(600))
    assert {m.step: m.value for m in history}[9] == pytest.approx(1.0)

    with Tracker("pretrain", system_metrics=False, flush_every_n=2, flush_every_s=3600) as t:
        t.log_metrics({"loss": 1.0, "lr": 1e-3}, step=0)  # exactly flush_every_n records
        assert [m.step for m in client.get_metric_history(t.run_id, "loss")] == [0]

    # A time limit flushes too, so the UI follows a slow run.
    with Tracker("pretrain", system_metrics=False, flush_every_n=10**6, flush_every_s=0.0) as t:
        t.log_metrics({"loss": 1.0}, step=0)
        assert [m.step for m in client.get_metric_history(t.run_id, "loss")] == [0]


def test_other_ranks_and_disabled_trackers_log_nothing(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/unused.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("RANK", "3")
    trackers = [Tracker("pretrain"), Tracker("pretrain", rank=1)]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("PIPELINE_TRACKING", "0")
    trackers.append(Tracker("pretrain"))
    for tracker in trackers:
        with tracker as t:
            t.log_params({"a": 1})
            t.set_tags({"b": 2})
            t.log_metrics({"loss": 1.0}, step=1)
            t.log_artifact(__file__)
            t.log_dict({"c": 3}, "c.json")
        assert not t.active and t.run_id is None and not t.offline
    assert not (tmp_path / "unused.db").exists()
    assert not (tmp_path / ".tracking-offline").exists()


def test_tags_record_git_dvc_and_stage(client, git_repo, monkeypatch):
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=git_repo, capture_output=True, text=True).stdout.strip()
    (git_repo / "train.py").write_text("print('edited')\n")  # tracked change: dirty
    from dvc.repo import Repo

    Repo.init(str(git_repo)).close()
    (git_repo / "dvc.yaml").write_text("stages:\n  pretrain:\n    cmd: python train.py\n    deps: [train.py]\n    outs: [out]\n")
    monkeypatch.setenv("DVC_EXP_NAME", "lusty-pike")
    monkeypatch.setenv("DVC_EXP_BASELINE_REV", head)
    with Tracker("pretrain", system_metrics=False, tags={"team": "llm"}) as t:
        t.set_tags({"note": "late"})
    tags = client.get_run(t.run_id).data.tags
    assert tags["mlflow.runName"] == "pretrain"
    assert tags["mlflow.source.git.commit"] == head and tags["git.dirty"] == "true"
    assert tags["pipeline.stage"] == "pretrain" and tags["dvc.stage"] == "pretrain"
    assert tags["dvc.exp_name"] == "lusty-pike" and tags["dvc.exp_baseline_rev"] == head
    assert tags["dvc.stage_hash"] == current_stage_fingerprint("pretrain") is not None
    assert tags["team"] == "llm" and tags["note"] == "late"


def test_a_failed_stage_fails_its_dvc_experiments_parent_run(client, tmp_path, monkeypatch):
    # Under `dvc exp run` the stages' parent run was created FINISHED and stayed so
    # when a stage failed: the MLflow UI showed a failed experiment as finished.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_EXP_NAME", "exp-x")

    def parents():
        runs = client.search_runs([t.experiment_id], filter_string="tags.`pipeline.parent` = 'true'",
                                  order_by=["attributes.start_time ASC"])
        return [(r.info.run_id, r.info.status) for r in runs]

    with Tracker("ingest", system_metrics=False) as t:
        pass
    first = t.parent_run_id
    with pytest.raises(RuntimeError), Tracker("clean", system_metrics=False) as t:
        raise RuntimeError("boom")
    assert t.parent_run_id == first  # the same experiment's parent
    assert client.get_run(t.run_id).info.status == "FAILED"
    assert parents() == [(first, "FAILED")]

    # The name may be run again (DVC committed nothing): that attempt gets its own parent.
    with Tracker("ingest", system_metrics=False) as t:
        pass
    with Tracker("clean", system_metrics=False) as t2:
        pass
    assert t.parent_run_id == t2.parent_run_id != first
    assert parents() == [(first, "FAILED"), (t.parent_run_id, "FINISHED")]


def test_an_experiment_name_with_a_quote_finds_its_parent_run(client, tmp_path, monkeypatch):
    # `dvc exp run -n "bob's-lr"` is a valid git ref; its name in the parent run's
    # search filter broke the filter, and every stage of it logged offline.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_EXP_NAME", "bob's-lr")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("ingest", system_metrics=False) as t:
            pass
        with Tracker("clean", system_metrics=False) as t2:
            pass
    assert not offline_warnings(caught) and not t.offline and not t2.offline
    assert t.parent_run_id is not None and t2.parent_run_id == t.parent_run_id
    assert client.get_run(t.parent_run_id).data.tags["dvc.exp_name"] == "bob's-lr"
    with pytest.raises(ValueError, match="both kinds of quote"):
        tracking._quoted("it's \"x\"")


def test_child_run_gets_parent_from_env(client, monkeypatch):
    parent_exp = client.create_experiment("parent-flow")
    parent = client.create_run(parent_exp, run_name="flow").info.run_id
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", parent)
    with Tracker("sft", system_metrics=False) as t:
        pass
    run = client.get_run(t.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.info.experiment_id == parent_exp  # same experiment, so the UI nests it
    assert run.info.run_name == "sft"

    # An unknown parent is a top-level run, not an outage.
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", "0" * 32)
    with Tracker("sft", system_metrics=False) as t:
        pass
    assert not t.offline and "mlflow.parentRunId" not in client.get_run(t.run_id).data.tags


def test_artifacts_land_under_the_absolute_artifact_location(client, db, tmp_path):
    meta = tmp_path / "meta.json"
    meta.write_text('{"step": 10}')
    ckpt = tmp_path / "final"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with Tracker("pretrain", system_metrics=False) as t:
        t.log_artifact(meta)
        t.log_artifact(ckpt, "export")
        t.log_dict({"loss": 1.5}, "summary.json")
    store = db[0] / "mlartifacts"
    exp = client.get_experiment(t.experiment_id)
    assert exp.artifact_location == store.as_uri()
    run_dir = store / t.run_id / "artifacts"
    assert client.get_run(t.run_id).info.artifact_uri == run_dir.as_uri()
    assert json.loads((run_dir / "meta.json").read_text()) == {"step": 10}
    assert (run_dir / "export" / "final" / "config.json").exists()
    assert json.loads((run_dir / "summary.json").read_text()) == {"loss": 1.5}


def test_exception_in_block_ends_run_failed(client):
    with pytest.raises(RuntimeError, match="nan loss"):
        with Tracker("pretrain", system_metrics=False) as t:
            t.log_metrics({"loss": 1.0}, step=0)
            raise RuntimeError("nan loss")
    run = client.get_run(t.run_id)
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(t.run_id, "loss")] == [0]  # flushed first


def test_ctrl_c_ends_the_run_killed_and_an_ended_run_keeps_its_status(client):
    with pytest.raises(KeyboardInterrupt), Tracker("pack", system_metrics=False) as t:
        raise KeyboardInterrupt
    assert client.get_run(t.run_id).info.status == "KILLED"
    with Tracker("pack", system_metrics=False) as t:  # as run_stage ends a failed stage's run before it exits
        assert t.start().run_id == t.run_id  # start is idempotent: one run
        t.end("FAILED")
    assert client.get_run(t.run_id).info.status == "FAILED"
    assert len(client.search_runs([t.experiment_id])) == 2


def test_a_failing_stage_does_not_end_its_flow_s_parent_run(client, monkeypatch):
    exp = tracking.ensure_experiment(uri=client.tracking_uri, client=client)
    parent = client.create_run(exp, run_name="pipeline").info.run_id
    monkeypatch.setenv("MLFLOW_PARENT_RUN_ID", parent)
    with pytest.raises(RuntimeError), Tracker("pack", system_metrics=False):
        raise RuntimeError("boom")
    assert client.get_run(parent).info.status == "RUNNING", "the flow ends its own parent run"


def test_a_deleted_experiment_is_restored(client):
    exp = tracking.ensure_experiment(uri=client.tracking_uri, client=client)
    client.delete_experiment(exp)
    with Tracker("pack", system_metrics=False) as t:
        pass
    assert t.experiment_id == exp and client.get_experiment(exp).lifecycle_stage == "active"


@contextlib.contextmanager
def http_server(status: int | None) -> Iterator[int]:
    """A local HTTP server answering every GET with ``status`` (None: no GET
    handler, so 501); yields its port."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Handler(BaseHTTPRequestHandler):
        if status is not None:
            def do_GET(self):
                self.send_error(status)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def test_a_server_that_answers_health_with_an_error_is_reachable():
    with http_server(404) as port:
        assert tracking.probe(f"http://127.0.0.1:{port}") is None
    assert "is unreachable" in tracking.probe(f"http://127.0.0.1:{closed_port()}")


def test_keys_lose_what_mlflow_refuses():
    assert tracking.mlflow_key("/data/raw/*.txt/") == "data/raw/_.txt"
    assert tracking.mlflow_key("sft.sources.{stdlib}.val_loss") == "sft.sources._stdlib_.val_loss"
    assert tracking.mlflow_key("//") == "_"


def test_two_metric_names_that_become_one_key_are_warned_of_once(client):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("ingest") as t:
            t.log_metrics({"sources.web[1].docs": 1, "sources.web{1}.docs": 2, "loss": 3}, step=0)
            t.log_metrics({"sources.web[1].docs": 4, "sources.web{1}.docs": 5}, step=1)
    clashes = [str(w.message) for w in caught if issubclass(w.category, tracking.TrackingWarning)]
    assert clashes == ["metrics 'sources.web[1].docs' and 'sources.web{1}.docs' are both logged as "
                       "'sources.web_1_.docs' (MLflow refuses some characters in a key); their values share one series"]
    history = client.get_metric_history(t.run_id, "sources.web_1_.docs")
    assert sorted(m.value for m in history) == [1, 2, 4, 5]


def test_system_metrics_switch(client, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    with Tracker("pretrain") as on:
        time.sleep(1.0)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    with Tracker("pretrain") as off:
        time.sleep(0.5)
    assert any(k.startswith("system/cpu") for k in client.get_run(on.run_id).data.metrics)
    assert not any(k.startswith("system/") for k in client.get_run(off.run_id).data.metrics)


# --------------------------------------------------------------------------- outage


@pytest.mark.timeout(60)
def test_unreachable_server_goes_offline_quickly_with_one_warning(tmp_path, monkeypatch, db):
    # As under `dvc exp run --temp`: cwd is a throw-away copy, DVC_ROOT the real repo.
    monkeypatch.delenv("PIPELINE_ROOT")
    repo, copy = tmp_path / "repo", tmp_path / "copy"
    repo.mkdir()
    copy.mkdir()
    monkeypatch.setenv("DVC_ROOT", str(repo))
    monkeypatch.chdir(copy)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")

    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pretrain", parent_run_id="abc") as t:
            t.log_params({"model": {"n_layer": 2}, "world_size": 2})
            for step in range(50):
                t.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
            t.log_dict({"tokens": 123}, "summary.json")
            t.log_artifact(__file__)
    assert time.monotonic() - start < 20  # MLflow's default retries would take minutes
    assert [w.category for w in caught] == [TrackingOfflineWarning]
    assert "unreachable" in str(caught[0].message)
    assert t.offline and t.run_id is None

    assert t.offline_path.parent == repo / ".tracking-offline"
    local, kept = offline_run(t)
    assert kept.info.run_name == "pretrain" and kept.info.status == "FINISHED"
    assert kept.data.params == {"model.n_layer": "2", "world_size": "2"}
    assert kept.data.tags["pipeline.stage"] == "pretrain" and kept.data.tags["mlflow.parentRunId"] == "abc"
    assert [m.step for m in local.get_metric_history(kept.info.run_id, "loss")] == list(range(50))
    assert json.loads(Path(local.download_artifacts(kept.info.run_id, "summary.json", str(tmp_path))).read_text()) == {"tokens": 123}

    # Nothing is lost: the file loads into MLflow later (the unknown parent is dropped).
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    run_id = replay_offline(t.offline_path)
    run = MlflowClient(db[1]).get_run(run_id)
    assert run.info.run_name == "pretrain" and run.info.status == "FINISHED"
    assert run.data.params["model.n_layer"] == "2"
    assert len(MlflowClient(db[1]).get_metric_history(run_id, "loss")) == 50
    assert {a.path for a in MlflowClient(db[1]).list_artifacts(run_id)} >= {"summary.json", Path(__file__).name}


@pytest.mark.timeout(60)
def test_an_offline_store_that_cannot_be_made_says_the_records_are_dropped(tmp_path, monkeypatch):
    """With the server unreachable and no offline store possible (the project
    root is not writable), the one warning used to say "records go to None"."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path / "file" / "project"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pack") as t:
            t.log_params({"seq_len": 64})
            t.log_metrics({"loss": 1.0}, step=1)
    [warning] = offline_warnings(caught)
    message = str(warning.message)
    assert t.offline and t.offline_path is None
    assert "the offline store" in message and message.endswith("Training continues; its records are dropped."), message
    assert "None" not in message and "replay" not in message, message


def test_failing_flush_mid_run_switches_to_offline(client, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pretrain", system_metrics=False, flush_every_n=10, flush_every_s=3600) as t:
            t.log_params({"lr": 0.1})
            for step in range(10):
                t.log_metrics({"loss": float(step)}, step=step)

            def server_gone(*args, **kwargs):
                raise ConnectionError("server went away")

            monkeypatch.setattr(t._client, "log_batch", server_gone)
            monkeypatch.setattr(t._client, "set_terminated", server_gone)
            for step in range(10, 30):
                t.log_metrics({"loss": float(step)}, step=step)
            t.log_params({"late": 1})
    assert len(offline_warnings(caught)) == 1
    assert t.offline and t.run_id is not None
    assert [m.step for m in client.get_metric_history(t.run_id, "loss")] == list(range(10))

    local, kept = offline_run(t)
    assert kept.data.tags["pipeline.offline.run_id"] == t.run_id
    assert "server went away" in kept.data.tags["pipeline.offline.reason"]
    assert [m.step for m in local.get_metric_history(kept.info.run_id, "loss")] == list(range(10, 30))
    assert kept.data.params == {"lr": "0.1", "late": "1"}
    assert kept.info.status == "FINISHED"

    # Replaying fills in the same run (replay makes its own, unpatched client).
    assert replay_offline(t.offline_path, uri=client.tracking_uri) == t.run_id
    assert [m.step for m in client.get_metric_history(t.run_id, "loss")] == list(range(30))
    run = client.get_run(t.run_id)
    assert run.info.status == "FINISHED" and run.data.params["late"] == "1"


@pytest.mark.timeout(60)
def test_offline_artifacts_are_kept_even_if_the_file_is_gone_before_replay(tmp_path, monkeypatch, db, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    meta = tmp_path / "meta.json"
    meta.write_text('{"step": 7}')
    with pytest.warns(TrackingOfflineWarning):
        with Tracker("pretrain", system_metrics=False) as t:
            t.log_artifact(meta)
    meta.unlink()  # e.g. the next run rewrote its checkpoint folder

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    assert tracking.main(["replay", str(t.offline_path)]) == 0
    run_id = capsys.readouterr().out.split()[-1]
    local = MlflowClient(db[1]).download_artifacts(run_id, "meta.json", str(tmp_path))
    assert json.loads(Path(local).read_text()) == {"step": 7}


def test_failure_while_ending_the_run_is_kept_offline(client, monkeypatch):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pretrain", system_metrics=False) as t:
            t.log_params({"lr": 0.1})
            t.log_metrics({"loss": 2.0}, step=5)

            def server_gone(*args, **kwargs):
                raise ConnectionError("server went away")

            monkeypatch.setattr(t._client, "set_terminated", server_gone)
    assert len(offline_warnings(caught)) == 1
    assert client.get_metric_history(t.run_id, "loss")[0].value == 2.0  # flushed before the failure
    _, kept = offline_run(t)
    assert "ending run" in kept.data.tags["pipeline.offline.reason"]
    assert kept.info.status == "FINISHED"


def offline_store(monkeypatch, steps: int = 3, end: bool = True) -> Tracker:
    """A tracker that went offline at once (no server), with ``steps`` losses logged."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    with pytest.warns(TrackingOfflineWarning):
        t = Tracker("pretrain", system_metrics=False).start()
    for step in range(steps):
        t.log_metrics({"loss": float(step)}, step=step)
    if end:
        t.end()
    return t


@pytest.mark.timeout(60)
def test_replay_refuses_what_is_not_an_offline_store_and_creates_nothing(tmp_path, monkeypatch, db, capsys):
    t = offline_store(monkeypatch)
    stores = t.offline_path.parent  # .tracking-offline/, the folder a user may well pass
    missing = tmp_path / "no-such-store"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    with pytest.raises(tracking.ReplayError, match="no such folder"):
        replay_offline(missing)
    with pytest.raises(tracking.ReplayError, match=r"not an offline store .* holds 1 store\(s\)"):
        replay_offline(stores)
    # Before, MLflow made an empty mlflow.db there (and the folder itself), then
    # replay failed with "not enough values to unpack".
    assert not missing.exists() and not (stores / "mlflow.db").exists()
    # A store whose run the tracker could not start (a full disk) holds none: it
    # failed with "ValueError: not enough values to unpack".
    from mlflow import MlflowClient

    empty = stores / "pretrain-empty"
    empty.mkdir()
    MlflowClient(offline_uri(empty)).search_experiments()
    with pytest.raises(tracking.ReplayError, match=r"the store holds 0 runs, not one; nothing to replay$"):
        replay_offline(empty)
    shutil.rmtree(empty)

    # One line per bad store, exit code 1, and the good stores are still replayed.
    assert tracking.main(["replay", str(stores), str(t.offline_path)]) == 1
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # MLflow logs its own lines too
    assert len(errors) == 1 and errors[0].startswith(f"error: {stores} is not an offline store"), err
    run_id = out.split()[-1]
    from mlflow import MlflowClient

    assert len(MlflowClient(db[1]).get_metric_history(run_id, "loss")) == 3


@pytest.mark.timeout(60)
def test_a_store_is_replayed_once_and_not_while_it_is_being_written(monkeypatch, db):
    from mlflow import MlflowClient

    t = offline_store(monkeypatch, end=False)  # this process still logs into it
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    with pytest.raises(tracking.ReplayError, match=f"still being logged by process {os.getpid()}"):
        replay_offline(t.offline_path)
    t.end()
    run_id = replay_offline(t.offline_path)
    with pytest.raises(tracking.AlreadyReplayed, match=f"replayed into run {run_id} at .* already"):
        replay_offline(t.offline_path)
    # `replay .tracking-offline/*/` again replays only the new stores: the old are skipped, not errors.
    assert tracking.main(["replay", str(t.offline_path)]) == 0
    client = MlflowClient(db[1])
    runs = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id], "a second replay made a second run"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [0, 1, 2]
    assert client.get_run(run_id).info.status == "FINISHED"


# --------------------------------------------------------------------------- DVC


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_store_of_a_process_that_died_replays_failed_to_each_server_once(tmp_path, monkeypatch, db):
    from mlflow import MlflowClient

    t = offline_store(monkeypatch, end=False)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    local, kept = offline_run(t)
    local.set_tag(kept.info.run_id, tracking.PID_TAG, str(dead.pid))  # the process that logged it is gone
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    run = MlflowClient(db[1]).get_run(replay_offline(t.offline_path))
    assert run.info.status == "FAILED"
    assert not [k for k in run.data.tags if k.startswith("pipeline.offline.")]
    other = f"sqlite:///{tmp_path / 'other.db'}"  # another server is not "replayed already"
    assert MlflowClient(other).get_run(replay_offline(t.offline_path, uri=other)).info.status == "FAILED"


def test_stage_fingerprint_matches_dvc_lock_and_run_cache(tmp_path):
    proj = tmp_path / "proj"
    (proj / "raw" / "sub").mkdir(parents=True)
    (proj / "raw" / "a.txt").write_text("alpha\n")
    (proj / "raw" / "sub" / "b.txt").write_text("beta\n")
    (proj / "src.py").write_text("# the trainer\n")
    # 1e-3 is a float only in YAML 1.2 (DVC's parser); `size` is a key DVC's hash drops.
    (proj / "params.yaml").write_text("prep:\n  lr: 1e-3\n  n: 3\ntrain:\n  steps: 2\n  size: 5\n")
    (proj / "dvc.yaml").write_text(
        "stages:\n"
        "  prep:\n"
        "    cmd: python -c \"import shutil; shutil.copytree('raw', 'prepared')\"\n"
        "    deps: [raw]\n"
        "    params: [prep]\n"
        "    outs: [prepared]\n"
        "  train:\n"
        "    cmd: python -c \"from pipeline.tracking.tracker import current_stage_fingerprint as f; "
        "open('fp.txt', 'w').write(f('train')); open('m.json', 'w').write('{}')\"\n"
        "    deps: [prepared, src.py]\n"
        "    params: [train, prep.lr]\n"
        "    outs: [fp.txt]\n"
        "    metrics:\n"
        "      - m.json:\n"
        "          cache: false\n"
    )
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "DVC_NO_ANALYTICS": "1"}
    subprocess.run([str(BIN / "dvc"), "init", "--no-scm", "-q"], cwd=proj, env=env, check=True)
    subprocess.run([str(BIN / "dvc"), "repro", "-q"], cwd=proj, env=env, check=True)

    hashes = dvc_stage_hashes(proj)
    assert set(hashes) == {"prep", "train"}
    # Computed inside the running stage, before DVC wrote its lock entry:
    assert (proj / "fp.txt").read_text() == hashes["train"]
    assert current_stage_fingerprint("prep", proj) == hashes["prep"]
    for key in hashes.values():  # DVC's own run-cache key, so the tag finds the cached run
        assert (proj / ".dvc" / "cache" / "runs" / key[:2] / key).is_dir()

    (proj / "params.yaml").write_text("prep:\n  lr: 1e-3\n  n: 3\ntrain:\n  steps: 3\n  size: 5\n")
    assert current_stage_fingerprint("train", proj) != hashes["train"]
    assert current_stage_fingerprint("prep", proj) == hashes["prep"]  # not its params
    assert current_stage_fingerprint("nope", proj) is None


# --------------------------------------------------------------------------- runs killed outright


KILLED_OUTRIGHT = """
import os, signal
from pipeline.tracking.tracker import Tracker
t = Tracker("{stage}").start()
print(t.run_id, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_run_whose_process_was_killed_outright_is_ended_killed_by_the_stage_s_next_run(client, tmp_path):
    env = {**os.environ, "PIPELINE_TRACKING": "1", "PYTHONPATH": str(ROOT)}
    orphans = {}
    for stage in ("clean", "pack"):
        proc = subprocess.run([sys.executable, "-c", KILLED_OUTRIGHT.format(stage=stage)], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -9, proc.stderr[-2000:]
        orphans[stage] = proc.stdout.split()[-1]
        assert client.get_run(orphans[stage]).info.status == "RUNNING"
    alive = Tracker("clean").start()  # this process: alive, so its run is left alone
    with Tracker("clean") as t:
        pass
    killed = client.get_run(orphans["clean"])
    assert killed.info.status == "KILLED"
    assert killed.data.tags["pipeline.ended_by"].startswith("found at ")
    assert f"by run {alive.run_id} of stage clean: its process (pid " in killed.data.tags["pipeline.ended_by"]
    assert client.get_run(alive.run_id).info.status == "RUNNING"
    assert client.get_run(orphans["pack"]).info.status == "RUNNING"  # another stage's: its next run ends it
    assert client.get_run(t.run_id).info.status == "FINISHED"
    alive.end()


def test_a_pid_that_was_given_to_a_later_process_is_not_the_run_s_process():
    import psutil

    me = psutil.Process()
    assert tracking._process_alive(me.pid, me.create_time())
    assert not tracking._process_alive(me.pid, me.create_time() - 3600)  # same pid, another process's start
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not tracking._process_alive(dead.pid, time.time())


# --------------------------------------------------------------------------- probe-trk: mutation survivors


def test_the_ui_binds_to_this_machine_only(tmp_path, monkeypatch):
    argv, _ = server_command(5001, root=tmp_path)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    execs = []

    def execvpe(*args):
        execs.append(args)
        raise SystemExit(0)  # as if the server had taken this process over

    monkeypatch.setattr(os, "execvpe", execvpe)
    with pytest.raises(SystemExit):
        tracking.main(["ui", "--port", "5002"])  # `python -m pipeline.tracking.tracker ui`
    (cmd, argv, env), = execs
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "5002"
    makefile = ROOT / "Makefile"
    if makefile.exists():
        assert "--host 127.0.0.1" in makefile.read_text()


def test_a_server_that_answers_with_another_tls_setup_is_reachable():
    # https:// to a plain HTTP server fails the TLS handshake: something answered there,
    # so MLflow's own TLS settings (MLFLOW_TRACKING_INSECURE_TLS, a CA bundle) get their try.
    with http_server(None) as port:
        assert tracking.probe(f"https://127.0.0.1:{port}") is None


def test_keys_are_cut_to_the_length_mlflow_takes(client):
    assert tracking.mlflow_key("k" * 300) == "k" * 250
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pretrain", system_metrics=False) as t:
            t.log_params({"p" * 300: 1})
            t.log_metrics({"m" * 300: 1.0}, step=0)
    assert not offline_warnings(caught) and not t.offline  # one key too long would cost the whole batch
    run = client.get_run(t.run_id)
    assert run.data.params == {"p" * 250: "1"} and run.data.metrics == {"m" * 250: 1.0}


@pytest.mark.parametrize("value", ["0", "false", "No", " off "])
def test_every_off_spelling_turns_tracking_off(tmp_path, monkeypatch, value):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/unused.db")
    monkeypatch.setenv("PIPELINE_TRACKING", value)
    with Tracker("pretrain") as t:
        t.log_params({"a": 1})
    assert not t.active and not (tmp_path / "unused.db").exists()
    monkeypatch.setenv("PIPELINE_TRACKING", "1")
    assert Tracker("pretrain").active


def test_a_param_logged_again_with_its_value_is_not_sent_again(client, batch_calls):
    with Tracker("pretrain", system_metrics=False) as t:
        t.log_params({"lr": 0.1, "n_layer": 2})
        sent = batch_calls["log_batch"]
        t.log_params({"lr": 0.1})  # a resumed trainer logs its config again
        assert batch_calls["log_batch"] == sent
        t.log_params({"lr": 0.1, "wd": 0.0})
        assert batch_calls["log_batch"] == sent + 1
    assert client.get_run(t.run_id).data.params == {"lr": "0.1", "n_layer": "2", "wd": "0.0"}


def test_a_failure_in_the_offline_store_is_logged_once_not_retried(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    with pytest.warns(TrackingOfflineWarning):
        t = Tracker("pretrain", system_metrics=False).start()
    assert t.offline and t.offline_path is not None
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise OSError("disk full")

    monkeypatch.setattr(t._client, "log_batch", failing)
    with caplog.at_level("ERROR", logger=tracking.log.name):
        t.log_params({"a": 1})  # never raises, and is not tried again and again
    assert len(calls) == 1 and "failed in the offline store" in caplog.text and "disk full" in caplog.text


def test_a_replayed_run_whose_parent_is_not_on_the_server_is_top_level(tmp_path, monkeypatch, db):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    with pytest.warns(TrackingOfflineWarning):
        with Tracker("pretrain", system_metrics=False, parent_run_id="gone") as t:
            t.log_metrics({"loss": 1.0}, step=3)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", db[1])
    run = MlflowClient(db[1]).get_run(replay_offline(t.offline_path))
    assert "mlflow.parentRunId" not in run.data.tags  # the UI would nest it under a run that is not there
    assert run.data.tags["pipeline.stage"] == "pretrain" and run.data.metrics == {"loss": 1.0}


def test_a_flow_s_parent_run_is_not_nested_under_an_experiment_parent(client, monkeypatch):
    monkeypatch.setenv("DVC_EXP_NAME", "exp-a")
    with Tracker(tracking.EXPERIMENT_PARENT_NAME, system_metrics=False) as t:
        pass
    assert "mlflow.parentRunId" not in client.get_run(t.run_id).data.tags
    assert [r.info.run_id for r in client.search_runs([t.experiment_id])] == [t.run_id]


def test_an_http_server_gets_retries_of_seconds_not_minutes(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")  # what the user set stays
    with pytest.warns(TrackingOfflineWarning):
        Tracker("pretrain", system_metrics=False).start()
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "30"


def test_a_password_in_the_tracking_uri_is_never_shown_or_kept(tmp_path, monkeypatch, caplog):
    # requests sends https://user:token@host as basic auth: a real way to give MLflow a password.
    uri = f"http://alice:s3cret@127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with caplog.at_level("INFO"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Tracker("pretrain", system_metrics=False) as t:
            t.log_params({"a": 1})
    (warning,) = offline_warnings(caught)
    assert "alice:***@127.0.0.1" in str(warning.message) and "s3cret" not in str(warning.message)
    _, kept = offline_run(t)
    assert kept.data.tags["pipeline.offline.tracking_uri"] == uri.replace("s3cret", "***")
    assert "s3cret" not in json.dumps(kept.data.tags) and "s3cret" not in caplog.text
    with pytest.raises(tracking.ReplayError) as err:  # the server is still down
        replay_offline(t.offline_path)
    assert "s3cret" not in str(err.value)
    assert tracking.redacted("see https://u:p@h/x and sqlite:////tmp/a:b@c.db") == "see https://u:***@h/x and sqlite:////tmp/a:b@c.db"


def test_a_server_behind_a_uri_with_a_password_is_probed_at_its_host():
    # urllib took "alice:s3cret@127.0.0.1" for a host name: such a server was always "unreachable"
    with http_server(401) as port:
        assert tracking.probe(f"http://alice:s3cret@127.0.0.1:{port}") is None


# --------------------------------------------------------------------------- probe3-track


def test_a_metric_that_is_no_number_raises_and_buffers_nothing(client):
    with Tracker("pretrain", system_metrics=False, flush_every_s=3600) as t:
        with pytest.raises(ValueError):
            t.log_metrics({"loss": 1.0, "acc": "high"}, step=3)
    assert client.get_run(t.run_id).data.metrics == {}  # not even the valid value before it


def test_a_relative_project_root_gives_an_absolute_tracking_uri(tmp_path, monkeypatch):
    # a stage that changes folder later must still find the same database
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_ROOT", "proj")
    assert tracking_uri() == f"sqlite:///{tmp_path}/proj/mlflow.db"


def test_git_tags_of_an_untracked_file_a_detached_head_and_no_git(git_repo, tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=git_repo, capture_output=True, text=True).stdout.strip()
    (git_repo / "scratch.txt").write_text("notes\n")  # untracked: not what the commit runs, so not dirty
    assert tracking.git_tags(git_repo) == {"mlflow.source.git.commit": head, "git.dirty": "false"}
    subprocess.run(["git", "checkout", "-q", "--detach"], cwd=git_repo, check=True)
    assert tracking.git_tags(git_repo) == {"mlflow.source.git.commit": head, "git.dirty": "false"}
    (tmp_path / "nogit").mkdir()
    assert tracking.git_tags(tmp_path / "nogit") == {}


def test_a_password_in_a_param_or_tag_is_not_logged(client, tmp_path, monkeypatch):
    # pyarrow reads s3://KEY:SECRET@bucket/...: a source path can hold a secret, and
    # the stage's config, and a dvc experiment's whole params.yaml, are logged as params.
    source = "s3://AKIA1:s3cret@bucket/c4/*.json.gz"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(f"ingest:\n  sources:\n    - path: {source}\n")
    monkeypatch.setenv("DVC_EXP_NAME", "exp-secret")
    with Tracker("ingest", system_metrics=False, tags={"origin": "https://bob:hunter2@example.org/x"}) as t:
        t.log_params({"ingest": {"sources": [{"path": source}]}})
        t.set_tags({"note": "from https://bob:hunter2@example.org/y"})
    run, parent = client.get_run(t.run_id), client.get_run(t.parent_run_id)
    assert run.data.params["ingest.sources.0.path"] == "s3://AKIA1:***@bucket/c4/*.json.gz"
    assert parent.data.params["ingest.sources.0.path"] == "s3://AKIA1:***@bucket/c4/*.json.gz"
    assert run.data.tags["origin"] == "https://bob:***@example.org/x"
    for logged in (run.data.params, run.data.tags, parent.data.params):
        assert "s3cret" not in json.dumps(logged) and "hunter2" not in json.dumps(logged)
    # a password may hold an @ (urllib and requests split at the last one): none of it shows
    assert tracking.redacted("https://u:p@ss@host/x") == "https://u:***@host/x"


def test_an_experiment_run_again_with_other_params_gets_a_parent_with_its_own_params(client, tmp_path, monkeypatch):
    # `dvc exp run -f -n lr-test -S pretrain.lr=...` overwrites an experiment of the same name:
    # its stages nested under the old parent run, whose params (immutable) were the old ones.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DVC_EXP_NAME", "lr-test")
    params = tmp_path / "params.yaml"
    params.write_text("pretrain:\n  lr: 0.001\n")
    with Tracker("ingest", system_metrics=False) as t:
        pass
    first = t.parent_run_id
    params.write_text("pretrain:\n  lr: 0.0003\n")
    with Tracker("ingest", system_metrics=False) as t:
        pass
    with Tracker("clean", system_metrics=False) as t2:
        pass
    assert t.parent_run_id != first and t2.parent_run_id == t.parent_run_id  # one parent per experiment run
    assert client.get_run(first).data.params["pretrain.lr"] == "0.001"
    assert client.get_run(t.parent_run_id).data.params["pretrain.lr"] == "0.0003"


def test_a_run_of_another_pid_namespace_on_this_host_name_is_not_taken_for_killed(client):
    # Containers with host networking share the host name, not the pids: a pid that this
    # container cannot see may be a live training run in the other one.
    if tracking._pid_namespace() is None:
        pytest.skip("no /proc/self/ns/pid here")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    exp_id = tracking.ensure_experiment(client=client)
    own = tracking._process_tags()
    runs = {}
    for ns in ("pid:[1]", own.get(tracking.PID_NS_TAG)):
        tags = {"pipeline.stage": "clean", **own, tracking.PID_TAG: str(dead.pid), tracking.PID_STARTED_TAG: f"{time.time():.2f}"}
        tags[tracking.PID_NS_TAG] = ns
        runs[ns] = client.create_run(exp_id, run_name="clean", tags=tags).info.run_id
    with Tracker("clean", system_metrics=False):
        pass
    assert client.get_run(runs["pid:[1]"]).info.status == "RUNNING"
    assert client.get_run(runs[own[tracking.PID_NS_TAG]]).info.status == "KILLED"
    client.set_terminated(runs["pid:[1]"])
