"""Tests for pipeline/promote.py: the promotion rule on its own, then the whole
registration against a throw-away SQLite MLflow (aliases, tags, artifact source)
and the outage policy."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from pipeline.export import export_model
from pipeline.files import sha256_file
from pipeline.promote import (
    CANDIDATE,
    CHAMPION,
    RegistryWarning,
    check_primary_metric,
    register_export,
    should_promote,
)
from tests.helpers import save_checkpoint, tiny_config, tiny_model, train_tiny_tokenizer

NAN = float("nan")


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("new, current, lower, expected", [
    (1.0, None, True, True),     # no champion yet
    (1.0, NAN, True, True),      # a champion without a valid value is beaten by any valid one
    (0.9, 1.0, True, True),
    (1.1, 1.0, True, False),
    (1.0, 1.0, True, False),     # a tie keeps the champion
    (1.1, 1.0, False, True),     # higher is better
    (0.9, 1.0, False, False),
    (1.0, 1.0, False, False),
    (None, 1.0, True, False),    # a missing metric is never promoted ...
    (None, None, True, False),   # ... not even to an empty throne
    (NAN, None, True, False),
    (NAN, 1.0, False, False),
    (-math.inf, 1.0, True, False),  # infinite: see test_an_infinite_metric_is_never_promoted...
])
def test_should_promote(new, current, lower, expected):
    assert should_promote(new, current, lower) is expected


# --------------------------------------------------------------------------- against MLflow


@pytest.fixture(scope="module")
def mlflow_env(tmp_path_factory):
    """A fresh SQLite tracking store for this module, with tracking switched on."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPELINE_ROOT", str(root))
        mp.setenv("PIPELINE_TRACKING", "1")
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.setenv("MLFLOW_EXPERIMENT_NAME", "registry-test")
        yield root


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export")
    tok = train_tiny_tokenizer(root / "tokenizer.json")
    save_checkpoint(root / "sft", tiny_model(tiny_config(tok.get_vocab_size())))
    export_model(root / "sft", root / "tokenizer.json", root / "export", card_info={})
    return root / "export"


@pytest.fixture(scope="module")
def client(mlflow_env):
    from mlflow import MlflowClient

    from pipeline.tracking.tracker import tracking_uri

    return MlflowClient(tracking_uri())


def register(export_dir, name, bpb, **kw):
    metrics = {"sft": {"chat": {"bits_per_byte": bpb}}, "pretrain": {"val_loss": 3.0}}
    return register_export(export_dir, model_name=name, metrics=metrics, **kw)


def aliases(client, name) -> dict[str, int]:
    return {a: int(v) for a, v in client.get_registered_model(name).aliases.items()}


def test_first_export_is_candidate_and_champion_and_a_better_one_takes_both(mlflow_env, client, export_dir):
    first = register(export_dir, "m-better", 1.5)
    assert first["registered"] and first["version"] == 1
    assert (first["candidate"], first["champion"], first["promoted"]) == (1, 1, True)
    assert aliases(client, "m-better") == {CANDIDATE: 1, CHAMPION: 1}

    second = register(export_dir, "m-better", 1.4)
    assert (second["version"], second["champion"], second["previous_champion"], second["promoted"]) == (2, 2, 1, True)
    assert "beats champion v1" in second["reason"]
    assert aliases(client, "m-better") == {CANDIDATE: 2, CHAMPION: 2}


def test_worse_tied_and_nan_exports_move_only_the_candidate(mlflow_env, client, export_dir):
    assert register(export_dir, "m-worse", 1.5)["champion"] == 1
    for version, bpb in ((2, 1.6), (3, 1.5), (4, NAN)):  # worse, tie, NaN
        result = register(export_dir, "m-worse", bpb)
        got = (result["version"], result["candidate"], result["champion"], result["promoted"])
        assert got == (version, version, 1, False)
        assert aliases(client, "m-worse") == {CANDIDATE: version, CHAMPION: 1}
    missing = register_export(export_dir, model_name="m-worse", metrics={"pretrain": {"val_loss": 1.0}})
    assert (missing["version"], missing["champion"], missing["promoted"]) == (5, 1, False)
    assert "missing, NaN or infinite" in missing["reason"]


def test_nan_never_becomes_the_first_champion(mlflow_env, client, export_dir):
    result = register(export_dir, "m-nan", NAN)
    assert (result["candidate"], result["champion"], result["promoted"]) == (1, None, False)
    assert aliases(client, "m-nan") == {CANDIDATE: 1}
    assert register(export_dir, "m-nan", 2.0)["champion"] == 2  # the first valid one is


def test_a_primary_metric_the_evaluation_lacks_is_refused_naming_the_closest():
    metrics = {"sft": {"chat": {"bits_per_byte": 1.3, "val_loss": math.nan}, "val_loss": 2.0}, "seconds": 4.0}
    check_primary_metric(metrics, "sft.chat.bits_per_byte")
    check_primary_metric(metrics, "sft.chat.val_loss")  # NaN is a result, not a typo
    with pytest.raises(ValueError, match=r"^'sft.chat.bits_per_bite' is not a metric of the evaluation, .*; did you "
                                         r"mean sft.chat.bits_per_byte\? it has 4: seconds, sft.chat.bits_per_byte, "
                                         r"sft.chat.val_loss, sft.val_loss$"):
        check_primary_metric(metrics, "sft.chat.bits_per_bite")
    with pytest.raises(ValueError, match="^'sft' is not a metric"):  # a section, not a number
        check_primary_metric(metrics, "sft")


def test_higher_is_better_when_asked(mlflow_env, client, export_dir):
    kw = dict(primary_metric="pretrain.val_loss", lower_is_better=False)
    register_export(export_dir, model_name="m-higher", metrics={"pretrain": {"val_loss": 1.0}}, **kw)
    result = register_export(export_dir, model_name="m-higher", metrics={"pretrain": {"val_loss": 2.0}}, **kw)
    assert result["promoted"] and aliases(client, "m-higher") == {CANDIDATE: 2, CHAMPION: 2}


def test_metrics_and_tags_are_stored_on_the_version(mlflow_env, client, export_dir):
    result = register_export(export_dir, model_name="m-tags", metrics={"sft": {"chat": {"bits_per_byte": 1.25}}},
                             tags={"git_commit": "abc123"})
    mv = client.get_model_version("m-tags", str(result["version"]))
    assert float(mv.tags["metric.sft.chat.bits_per_byte"]) == 1.25
    assert mv.tags["primary_metric"] == "sft.chat.bits_per_byte" and mv.tags["lower_is_better"] == "true"
    assert mv.tags["git_commit"] == "abc123"


def test_metrics_of_sources_with_default_names_are_stored_and_compared(mlflow_env, client, export_dir):
    # A val source without `name` is named by its path ("data/raw/*.txt", "{stdlib}",
    # "data/raw/wiki[validation]"); MLflow refuses those characters in a tag key, and
    # the whole registration failed: no candidate, no champion.
    def evaluation(bpb):
        return {"sft": {"chat": {"bits_per_byte": 1.0},
                        "sources": {"data/raw/wiki[validation]": {"bits_per_byte": bpb}, "{stdlib}": {"val_loss": 2.0}}}}

    kw = dict(model_name="m-sources", primary_metric="sft.sources.data/raw/wiki[validation].bits_per_byte")
    first = register_export(export_dir, metrics=evaluation(1.5), **kw)
    assert first["registered"] and first["promoted"], first["reason"]
    tags = client.get_model_version("m-sources", str(first["version"])).tags
    assert float(tags["metric.sft.sources.data/raw/wiki_validation_.bits_per_byte"]) == 1.5
    assert float(tags["metric.sft.sources._stdlib_.val_loss"]) == 2.0
    worse, better = register_export(export_dir, metrics=evaluation(1.6), **kw), register_export(
        export_dir, metrics=evaluation(1.4), **kw)
    assert (worse["promoted"], better["promoted"], better["previous_champion"]) == (False, True, 1)


def test_a_registration_without_a_run_ends_the_run_it_made(mlflow_env, client, export_dir):
    result = register(export_dir, "m-own-run", 1.0)
    run = client.get_run(result["run_id"])
    assert (run.info.run_name, run.info.status) == ("register", "FINISHED")


def test_a_registration_that_fails_after_making_its_run_ends_that_run_failed(mlflow_env, client, export_dir,
                                                                             monkeypatch):
    """The run a registration makes for itself stayed RUNNING when a later step failed."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    def refuse(*args, **kwargs):
        raise MlflowException("the registry refuses")

    monkeypatch.setattr(MlflowClient, "create_model_version", refuse)
    with pytest.warns(RegistryWarning, match="the registry refuses"):
        result = register(export_dir, "m-fails", 1.0)
    assert result["registered"] is False
    assert client.get_run(result["run_id"]).info.status == "FAILED"


def test_a_champion_whose_metric_tag_is_no_number_is_replaced(mlflow_env, client, export_dir):
    register(export_dir, "m-bad-tag", 1.0)
    client.set_model_version_tag("m-bad-tag", "1", "metric.sft.chat.bits_per_byte", "n/a")  # edited by hand
    result = register(export_dir, "m-bad-tag", 2.0)
    assert (result["promoted"], result["champion"]) == (True, 2)
    assert "champion v1 has no valid sft.chat.bits_per_byte" in result["reason"]


def test_a_version_tag_longer_than_mlflow_takes_is_cut_not_fatal(mlflow_env, client, export_dir):
    result = register(export_dir, "m-long-tag", 1.0, tags={"note": "x" * 9000})
    assert result["registered"], result["reason"]
    assert client.get_model_version("m-long-tag", "1").tags["note"] == "x" * 8000


def test_the_version_source_holds_the_logged_export(mlflow_env, client, export_dir, tmp_path):
    import mlflow

    run = client.create_run(client.get_experiment_by_name("registry-test").experiment_id, run_name="export")
    result = register(export_dir, "m-source", 1.0, run_id=run.info.run_id)
    mv = client.get_model_version("m-source", str(result["version"]))
    assert mv.run_id == run.info.run_id
    assert mv.source == result["source"] and mv.source.startswith(run.info.artifact_uri)
    for uri in (mv.source, f"models:/m-source@{CHAMPION}"):
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / uri[:6])))
        assert (local / "config.json").is_file()
        assert sha256_file(local / "model.safetensors") == sha256_file(export_dir / "model.safetensors")


# --------------------------------------------------------------------------- outages


def test_an_unreachable_server_is_a_warning_not_an_error(monkeypatch, tmp_path, export_dir):
    monkeypatch.setenv("PIPELINE_TRACKING", "1")
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.warns(RegistryWarning, match="unreachable"):
        result = register(export_dir, "m-down", 1.0)
    assert result["registered"] is False and "unreachable" in result["reason"]


def test_a_failing_store_is_a_warning_not_an_error(monkeypatch, tmp_path, export_dir):
    monkeypatch.setenv("PIPELINE_TRACKING", "1")
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path))
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'not-a-dir' / 'mlflow.db'}")
    with pytest.warns(RegistryWarning, match="failed"):
        result = register(export_dir, "m-broken", 1.0)
    assert result["registered"] is False


def test_disabled_tracking_registers_nothing(monkeypatch, export_dir):
    monkeypatch.setenv("PIPELINE_TRACKING", "0")
    assert register(export_dir, "m-off", 1.0) == {"registered": False,
                                                   "reason": "tracking is disabled (PIPELINE_TRACKING=0)"}


# --------------------------------------------------------------------------- probe-trk: mutation survivors


def test_a_bool_is_no_metric_value():
    assert should_promote(True, 2.0) is False  # True < 2.0 in Python, but a flag is not a result
    assert should_promote(1.0, True) is True


def test_a_registered_model_created_meanwhile_by_a_parallel_run_is_used(mlflow_env, client, export_dir, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    assert register(export_dir, "m-race", 1.5)["version"] == 1
    original, calls = MlflowClient.get_registered_model, []

    def not_yet(self, name):  # the other run creates it between our look and our create
        calls.append(name)
        if len(calls) == 1:
            raise MlflowException("not found", error_code=RESOURCE_DOES_NOT_EXIST)
        return original(self, name)

    monkeypatch.setattr(MlflowClient, "get_registered_model", not_yet)
    result = register(export_dir, "m-race", 1.4)
    assert result["registered"] and (result["version"], result["champion"]) == (2, 2)


def test_a_failure_reading_the_champion_registers_no_champion(mlflow_env, client, export_dir, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR

    assert register(export_dir, "m-alias-error", 1.5)["champion"] == 1

    def broken(self, name, alias):
        raise MlflowException("database is locked", error_code=INTERNAL_ERROR)

    monkeypatch.setattr(MlflowClient, "get_model_version_by_alias", broken)
    with pytest.warns(RegistryWarning, match="database is locked"):
        result = register(export_dir, "m-alias-error", 9.9)  # worse: must not be taken for a first champion
    assert result["registered"] is False and result["candidate"] == 2
    monkeypatch.undo()
    assert aliases(client, "m-alias-error") == {CANDIDATE: 2, CHAMPION: 1}


def test_a_failed_registration_leaves_the_stage_s_own_run_running(mlflow_env, client, export_dir, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.tracking.tracker import ensure_experiment

    stage_run = client.create_run(ensure_experiment(client=client), run_name="export").info.run_id

    def refuse(*args, **kwargs):
        raise MlflowException("the registry refuses")

    monkeypatch.setattr(MlflowClient, "create_model_version", refuse)
    with pytest.warns(RegistryWarning, match="the registry refuses"):
        result = register(export_dir, "m-stage-run", 1.0, run_id=stage_run)
    assert result["registered"] is False and result["run_id"] == stage_run
    assert client.get_run(stage_run).info.status == "RUNNING"  # the stage's Tracker ends it, as the stage ends
    client.set_terminated(stage_run)


@pytest.mark.parametrize("value", ["0", "false", "no", "Off"])
def test_every_off_spelling_registers_nothing(mlflow_env, monkeypatch, export_dir, value):
    monkeypatch.setenv("PIPELINE_TRACKING", value)
    assert register(export_dir, "m-off", 1.0)["registered"] is False


def test_a_password_in_the_tracking_uri_is_not_in_the_warning(monkeypatch, tmp_path, export_dir):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIPELINE_TRACKING", "1")
    monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://alice:s3cret@127.0.0.1:{port}")
    with pytest.warns(RegistryWarning) as caught:
        result = register(export_dir, "m-secret", 1.0)
    assert result["registered"] is False and "alice:***@" in result["reason"]
    assert not any("s3cret" in str(w.message) for w in caught) and "s3cret" not in result["reason"]


# --------------------------------------------------------------------------- probe3-track


def test_a_missing_folder_or_one_that_is_no_export_is_refused(mlflow_env, client, export_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no export folder"):
        register(tmp_path / "gone", "m-refused", 1.0)
    notes = tmp_path / "notes"  # e.g. `models/sft` given for `models/export`: no config.json, no weights
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face export"):
        register(notes, "m-refused", 1.0)
    assert client.search_registered_models("name = 'm-refused'") == []


def test_a_registry_that_refuses_to_show_the_model_registers_nothing(mlflow_env, client, export_dir, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED

    assert register(export_dir, "m-denied", 1.5)["version"] == 1

    def denied(self, name):
        raise MlflowException("no read access", error_code=PERMISSION_DENIED)

    monkeypatch.setattr(MlflowClient, "get_registered_model", denied)
    with pytest.warns(RegistryWarning, match="no read access"):
        result = register(export_dir, "m-denied", 1.0)
    assert result["registered"] is False and "version" not in result


def test_a_password_in_an_mlflow_error_is_not_in_the_reason(mlflow_env, export_dir, monkeypatch):
    from mlflow import MlflowClient

    def refuse(*args, **kwargs):
        raise OSError("cannot upload to https://bob:hunter2@store.example.org/a")

    monkeypatch.setattr(MlflowClient, "log_artifacts", refuse)
    with pytest.warns(RegistryWarning) as caught:
        result = register(export_dir, "m-upload", 1.0)
    assert result["registered"] is False and "bob:***@store" in result["reason"]
    assert "hunter2" not in result["reason"] and not any("hunter2" in str(w.message) for w in caught)



@pytest.mark.parametrize("new, current, lower, expected", [
    (math.inf, None, True, False),    # a diverged evaluation is never champion, as NaN is not
    (-math.inf, 1.0, True, False),    # nor could anything ever beat it after
    (math.inf, 1.0, False, False),
    (1.0, -math.inf, True, True),     # a champion stored with one is replaced by any finite value
    (1.0, math.inf, False, True),
])
def test_an_infinite_metric_is_never_promoted_and_never_keeps_the_title(new, current, lower, expected):
    assert should_promote(new, current, lower) is expected


def test_a_champion_with_an_infinite_metric_is_replaced(mlflow_env, client, export_dir):
    register(export_dir, "m-inf", 1.0)
    client.set_model_version_tag("m-inf", "1", "metric.sft.chat.bits_per_byte", "-inf")  # an evaluation bug
    result = register(export_dir, "m-inf", 2.0)
    assert (result["promoted"], result["champion"]) == (True, 2)
    assert register(export_dir, "m-inf", math.inf)["champion"] == 2


def test_a_registry_on_http_gets_retries_of_seconds_not_minutes(monkeypatch, tmp_path, export_dir):
    # MLflow's own retries last about four minutes per call when the server dies mid-registration
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from pipeline.tracking.tracker import HTTP_DEFAULTS

    class Forbidden(BaseHTTPRequestHandler):
        def do_GET(self):  # reachable (so probed healthy), but refuses every call
            self.send_error(403)

        def log_message(self, *args):
            pass

    for var in HTTP_DEFAULTS:  # unset here, and unset again after the test (setenv records the state to restore)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    server = HTTPServer(("127.0.0.1", 0), Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIPELINE_TRACKING", "1")
        monkeypatch.setenv("PIPELINE_ROOT", str(tmp_path))
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.server_port}")
        with pytest.warns(RegistryWarning):
            assert register(export_dir, "m-http", 1.0)["registered"] is False
    finally:
        server.shutdown()
        server.server_close()
    assert {var: os.environ.get(var) for var in HTTP_DEFAULTS} == HTTP_DEFAULTS


def test_a_password_in_a_version_tag_is_not_stored(mlflow_env, client, export_dir):
    result = register(export_dir, "m-tag-secret", 1.0, tags={"data": "s3://AKIA1:s3cret@bucket/c4"})
    assert client.get_model_version("m-tag-secret", str(result["version"])).tags["data"] == "s3://AKIA1:***@bucket/c4"


def test_the_champion_is_read_compared_and_moved_under_the_project_lock(mlflow_env, client, export_dir, monkeypatch):
    # Two exports finishing together (dvc exp run --run-all -j 2) both read the
    # same champion and both moved the alias: the last won, even when worse.
    import fcntl

    from mlflow import MlflowClient

    from pipeline import promote

    def held() -> bool:  # another open file description of the lock cannot take it while it is held
        with open(mlflow_env / promote.PROMOTE_LOCK, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    seen = []
    read, move = promote._champion, MlflowClient.set_registered_model_alias
    monkeypatch.setattr(promote, "_champion", lambda *a: (seen.append(("read", held())), read(*a))[1])
    monkeypatch.setattr(MlflowClient, "set_registered_model_alias",
                        lambda self, name, alias, v: (seen.append((alias, held())), move(self, name, alias, v))[1])
    register(export_dir, "m-locked", 1.5)
    assert seen == [(CANDIDATE, False), ("read", True), (CHAMPION, True)]
    assert not held()  # and let go after


def test_a_champion_moved_without_a_lock_is_said(mlflow_env, client, export_dir, monkeypatch, tmp_path):
    from pipeline import promote

    monkeypatch.setattr(promote, "project_root", lambda: tmp_path / "gone")  # no folder to hold the lock file
    with pytest.warns(RegistryWarning, match=r"moving the champion without a lock \(.*gone/\.promote\.lock: No such "
                                             r"file or directory\)"):
        result = register(export_dir, "m-unlocked", 1.5)
    assert result["promoted"] and aliases(client, "m-unlocked") == {CANDIDATE: 1, CHAMPION: 1}
