import enum
import io
import json
import os
import pickle
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import PosixPath

import numpy as np
import pytest
import torch

from pipeline.files import sha256_file
from pipeline.training import checkpoint as ckpt
from pipeline.training.distributed import Dist


class Tiny(torch.nn.Module):
    def __init__(self, n=8, tie=True):
        super().__init__()
        self.emb = torch.nn.Embedding(10, n)
        self.out = torch.nn.Linear(n, 10, bias=False)
        if tie:
            self.out.weight = self.emb.weight


def make(tmp_path, step, keep=2, model=None):
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters())
    loss = model.out(model.emb(torch.tensor([1, 2]))).sum()
    loss.backward()
    opt.step()
    return ckpt.save(tmp_path, step, model, opt, {"step": step, "rng": [ckpt.rng_state()]}, {"note": "x"}, keep=keep)


def test_save_load_roundtrip_with_tied_weights(tmp_path):
    m = Tiny()
    c = make(tmp_path, 5, model=m)
    assert c.step == 5 and c.meta["step"] == 5 and set(c.meta["files"]) == {"model.safetensors", "optimizer.pt", "trainer.pt"}
    m2 = Tiny()
    ckpt.load_model_weights(c, m2)
    assert torch.equal(m2.emb.weight, m.emb.weight) and m2.out.weight is m2.emb.weight
    state = ckpt.load_state(c, "optimizer.pt")
    assert state["state"][0]["step"].item() == 1


def test_keep_last_k_and_latest(tmp_path):
    for s in (1, 2, 3, 4):
        make(tmp_path, s, keep=2)
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.latest(tmp_path).step == 4


def test_incomplete_folders_are_ignored_and_swept(tmp_path):
    make(tmp_path, 1)
    (tmp_path / ".tmp-step-00000002-123").mkdir()
    partial = tmp_path / "step-00000003"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"junk")
    assert ckpt.latest(tmp_path).step == 1
    ckpt.sweep(tmp_path)
    assert not (tmp_path / ".tmp-step-00000002-123").exists()


def test_a_checkpoint_whose_replacement_was_cut_short_is_put_back_not_swept(tmp_path, caplog):
    """Re-saving step 2 was killed between the swap's two renames: step-00000002 is
    missing and lies whole as .old-step-00000002-<pid>; the run resumes from it."""
    m = manager(tmp_path)
    run_saves(m, [1, 2])
    os.replace(tmp_path / "step-00000002", tmp_path / ".old-step-00000002-4242")
    (tmp_path / ".tmp-step-00000002-4242").mkdir()  # the new copy, unfinished
    with caplog.at_level("WARNING"):
        m.prepare()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".json")) == \
        ["step-00000001", "step-00000002"]
    assert m.resume_point().step == 2
    assert "an earlier replacement of it was interrupted" in caplog.text


def test_damaged_file_is_detected(tmp_path):
    c = make(tmp_path, 1)
    with open(c.path / "optimizer.pt", "ab") as f:
        f.write(b"extra")
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.load_state(c, "optimizer.pt")


def test_rng_state_roundtrip():
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    s = ckpt.rng_state()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9); np.random.seed(9); torch.manual_seed(9)
    ckpt.set_rng_state(s)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


class FakeGPUs:
    """torch.cuda's RNG calls on a machine of ``n`` GPUs, of which this rank's is ``current``."""

    def __init__(self, n: int, current: int):
        self.states = [torch.tensor([i], dtype=torch.uint8) for i in range(n)]
        self.current = current

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": self.states[self.current].clone())
        monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in self.states])

        def set_state(state, device="cuda"):
            self.states[self.current] = state.clone()

        def set_all(states):
            for i, state in enumerate(states):
                self.states[i] = state.clone()  # IndexError past this machine's GPUs, as torch's invalid ordinal

        monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
        return self


def test_a_rank_saves_and_restores_only_its_own_gpu_s_rng(monkeypatch):
    """Each rank's checkpoint RNG holds its own GPU's generator, and restores only
    that one: it held every GPU's, so 8 ranks each wrote 8 states, and a resume
    where a rank sees fewer GPUs (one visible device per rank) failed."""
    gpus = FakeGPUs(8, current=3).install(monkeypatch)
    state = ckpt.rng_state()
    assert torch.equal(state["cuda"], torch.tensor([3], dtype=torch.uint8))
    one = FakeGPUs(1, current=0).install(monkeypatch)  # the same rank resumed where it sees only its GPU
    ckpt.set_rng_state(state)
    assert one.states == [torch.tensor([3], dtype=torch.uint8)]
    # a checkpoint of the earlier layout (every GPU's state): the rank takes its own device's
    old = {**state, "cuda": [torch.tensor([10 + i], dtype=torch.uint8) for i in range(8)]}
    ckpt.set_rng_state(old)
    assert one.states == [torch.tensor([10], dtype=torch.uint8)]
    assert gpus.states[3] == torch.tensor([3], dtype=torch.uint8)


def test_trainer_state_needs_no_pickle(tmp_path):
    c = make(tmp_path, 1)
    # weights_only=True refuses arbitrary objects; our files must load under it
    torch.load(c.path / "trainer.pt", weights_only=True)
    torch.load(c.path / "optimizer.pt", weights_only=True)


WRITER = textwrap.dedent("""
    import sys, torch
    from pipeline.training import checkpoint as ckpt
    from pipeline.training.distributed import Dist
    folder, layout = sys.argv[1], sys.argv[2]
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward(); opt.step()
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        if layout == "sharded":
            ckpt.save_sharded(ckpt.Path(folder), step, model, opt, {"step": step}, {}, 2, Dist(0, 0, 1, torch.device("cpu"), None))
        else:
            ckpt.save(ckpt.Path(folder), step, model, opt, {"step": step}, {}, keep=2)
        print(step, flush=True)
""")


@pytest.mark.parametrize("layout,delay", [("file", 0.05), ("file", 0.13), ("file", 0.29), ("file", 0.41),
                                          ("sharded", 0.07), ("sharded", 0.23)])
def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path, root, layout, delay):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), layout], cwd=root, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "1"  # at least one save finished
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last = ckpt.latest(tmp_path)
    assert last is not None
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    ckpt.load_model_weights(last, model)
    assert all(torch.all(p == float(last.step)) for p in model.parameters())
    assert ckpt.is_sharded(last) == (layout == "sharded")
    assert ckpt.load_state(last, "trainer.pt") == {"step": last.step}
    assert json.loads((last.path / "meta.json").read_text())["step"] == last.step


# --------------------------------------------------------------------------- verification


def flip_byte(file):
    """Corrupt ``file`` without changing its size, as a bad disk would."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def manager(tmp_path, fingerprint="a" * 16, keep=3, is_main=True):
    return ckpt.CheckpointManager(tmp_path, fingerprint=fingerprint, keep=keep, is_main=is_main)


def run_saves(m, steps, model=None):
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model.out(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    for s in steps:
        m.save(s, model, opt, {"step": s}, {"note": "x"})
    return model


def test_verify_hashes_each_checkpoint_once_until_a_file_changes(tmp_path, monkeypatch):
    c = make(tmp_path, 1)
    calls = []
    real = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: calls.append(p) or real(p))
    ckpt.verify(c)
    ckpt.load_model_weights(c, Tiny())
    ckpt.load_state(c, "optimizer.pt")
    ckpt.load_state(c, "trainer.pt")
    assert len(calls) == 3  # model, optimizer, trainer: hashed by the first verify only
    flip_byte(c.path / "trainer.pt")  # a change after a verify is still caught
    with pytest.raises(ckpt.CheckpointError, match="trainer.pt: sha256 differs"):
        ckpt.load_state(c, "trainer.pt")


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer.pt"])
def test_resume_falls_back_past_a_flipped_byte_with_a_warning(tmp_path, caplog, name):
    m = manager(tmp_path)
    run_saves(m, [1, 2, 3])
    flip_byte(tmp_path / "step-00000003" / name)
    with caplog.at_level("WARNING"):
        assert m.resume_point().step == 2
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"{tmp_path / 'step-00000003' / name}: sha256 differs from the one recorded in meta.json" in warning
    assert "checkpoint step-00000003 is damaged" in warning and "resuming from the older step-00000002" in warning


def test_a_damaged_checkpoint_the_run_resumes_before_is_set_aside_not_overwritten(tmp_path, caplog):
    m = manager(tmp_path)
    run_saves(m, [1, 2, 3, 4])
    flip_byte(tmp_path / "step-00000004" / "optimizer.pt")  # the weights may be whole
    (tmp_path / "step-00000003" / "meta.json").unlink()
    weights = (tmp_path / "step-00000004" / "model.safetensors").read_bytes()
    with caplog.at_level("WARNING"):
        m.prepare()
    assert sorted(p.name for p in (tmp_path / "damaged").iterdir()) == ["step-00000003", "step-00000004"]
    assert (tmp_path / "damaged" / "step-00000004" / "model.safetensors").read_bytes() == weights
    assert "moved aside to" in caplog.text and "will save step 4 again" in caplog.text
    assert m.resume_point().step == 2
    run_saves(m, [3, 4])  # the run goes on: the set-aside copies stay
    assert (tmp_path / "damaged" / "step-00000004" / "model.safetensors").read_bytes() == weights
    # with no intact checkpoint nothing moves: the run stops and names the damage
    left = ckpt.step_folders(tmp_path)
    for c in left:
        flip_byte(c.path / "trainer.pt")
    m.prepare()
    assert ckpt.step_folders(tmp_path) == left
    with pytest.raises(ckpt.CheckpointError, match="no intact checkpoint"):
        m.resume_point()


def test_a_truncated_file_is_named_with_its_size(tmp_path):
    m = manager(tmp_path)
    run_saves(m, [1, 2])
    f = tmp_path / "step-00000002" / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size - 7)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.verify(ckpt.Checkpoint(f.parent, 2))
    assert str(err.value) == (f"{f}: size {size - 7} bytes differs from the {size} recorded in meta.json "
                              "(checkpoint step-00000002 is damaged)")
    assert m.resume_point().step == 1


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer.pt"])
def test_a_file_meta_json_records_no_sha256_for_is_damage_not_trusted(tmp_path, name):
    """Every file a load reads must be hashed: a meta.json that leaves one out
    (trainer.pt holds the data position and RNG states) cannot vouch for it."""
    c = make(tmp_path, 1)
    meta = json.loads((c.path / "meta.json").read_text())
    del meta["files"][name]
    (c.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.verify(c)
    assert str(err.value) == (f"{c.path / 'meta.json'}: records no size and sha256 for {name} "
                              "(checkpoint step-00000001 is damaged)")


@pytest.mark.parametrize("name", ["../step-00000002/model.safetensors", "sub/trainer.pt"])
def test_a_meta_json_that_records_a_path_outside_the_folder_is_damage(tmp_path, name):
    """meta.json may vouch only for the checkpoint's own files, never for one
    elsewhere (here another checkpoint's, whose size and sha256 it states rightly)."""
    c, other = make(tmp_path, 1, keep=3), make(tmp_path, 2, keep=3)
    (c.path / "sub").mkdir()
    (c.path / "sub" / "trainer.pt").write_bytes((other.path / "trainer.pt").read_bytes())
    meta = json.loads((c.path / "meta.json").read_text())
    f = c.path / name
    meta["files"][name] = {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
    (c.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.verify(c)
    assert str(err.value) == (f"{c.path / 'meta.json'}: records the file name {name!r}, which is not a file of a "
                              "checkpoint (checkpoint step-00000001 is damaged)")



@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_step_folder_renamed_by_hand_is_damage_not_a_later_step(tmp_path, caplog, layout):
    """step-00000009 holding step 2's checkpoint would resume at step 2 as if it were 9,
    and its save of step 9 would replace it: it counts as damaged, named in one line."""
    if layout == "sharded":
        sharded(tmp_path, [1, 2])
    else:
        run_saves(manager(tmp_path), [1, 2])
    os.replace(tmp_path / "step-00000002", tmp_path / "step-00000009")
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000009/meta.json: records step 2, but the folder is named "
                                                   r"step-00000009 \(renamed by hand\?\); name it step-00000002"):
        ckpt.resolve(tmp_path)
    assert manager(tmp_path).resume_point().step == 1
    meta = json.loads((tmp_path / "step-00000001" / "meta.json").read_text())
    (tmp_path / "step-00000001" / "meta.json").write_text(json.dumps({**meta, "step": "1"}))
    with pytest.raises(ckpt.CheckpointError, match=r"meta.json: records the step '1', which is not a whole number"):
        ckpt.verify(tmp_path / "step-00000001")


def test_a_step_folder_without_meta_is_damaged_not_absent(tmp_path, caplog):
    m = manager(tmp_path)
    run_saves(m, [1, 2])
    (tmp_path / "step-00000002" / "meta.json").unlink()
    with caplog.at_level("WARNING"):
        assert m.resume_point().step == 1
    assert f"{tmp_path / 'step-00000002' / 'meta.json'}: missing" in caplog.text
    assert "checkpoint step-00000002 is damaged" in caplog.text
    (tmp_path / "step-00000001" / "meta.json").write_text("{not json")
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000001/meta.json: unreadable"):
        m.resume_point()


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    m = manager(tmp_path)
    run_saves(m, [1, 2])
    flip_byte(tmp_path / "step-00000001" / "optimizer.pt")
    (tmp_path / "step-00000002" / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError) as err:
        m.resume_point()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{tmp_path}: no intact checkpoint to resume from")
    assert "step-00000002/meta.json: missing" in msg and "step-00000001/optimizer.pt: sha256 differs" in msg
    # the stage runner prints StageErrors as one line, without a traceback
    from pipeline.runner import StageError
    assert isinstance(err.value, StageError)
    assert manager(tmp_path / "empty").resume_point() is None


def test_damaged_weights_are_never_loaded(tmp_path):
    c = make(tmp_path, 1)
    flip_byte(c.path / "model.safetensors")
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors: sha256 differs"):
        ckpt.load_model_weights(c, model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_manager_load_checks_every_file_before_loading_any(tmp_path):
    m = manager(tmp_path)
    run_saves(m, [1])
    c = ckpt.Checkpoint(tmp_path / "step-00000001", 1)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    assert m.load(c, model, opt) == {"step": 1} and opt.state_dict()["state"][0]["step"].item() == 1
    flip_byte(c.path / "optimizer.pt")
    fresh = Tiny()
    before = fresh.emb.weight.clone()
    with pytest.raises(ckpt.CheckpointError, match="optimizer.pt: sha256 differs"):
        m.load(c, fresh, torch.optim.AdamW(fresh.parameters()))
    assert torch.equal(fresh.emb.weight, before)


# --------------------------------------------------------------------------- the manager


def test_manager_saves_its_fingerprint_and_keeps_the_newest(tmp_path):
    m = manager(tmp_path, keep=2)
    run_saves(m, [1, 2, 3, 4])
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 4]
    assert ckpt.latest(tmp_path).meta["fingerprint"] == "a" * 16
    assert m.resume_point().step == 4
    with pytest.raises(RuntimeError, match="main rank only"):
        run_saves(manager(tmp_path, is_main=False), [5])



@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_keep_last_k_never_deletes_a_checkpoint_of_another_run_put_in_the_folder(tmp_path, layout):
    """A checkpoint copied into the run folder while the run trains (another run's, or
    one whose meta.json cannot be read) is not this run's to delete: keep-last-K counts
    and removes only the run's own; the next prepare() moves the other one aside."""
    m = manager(tmp_path, fingerprint="run", keep=1)
    model, opt = trained()
    how = {"sharded": ALONE} if layout == "sharded" else {}
    m.save(1, model, opt, {"step": 1}, {}, **how)
    manager(tmp_path / "other", fingerprint="other").save(2, model, opt, {"step": 2}, {}, **how)
    os.replace(tmp_path / "other" / "step-00000002", tmp_path / "step-00000002")
    (tmp_path / "step-00000001" / "meta.json").write_text("{not json")
    for step in (3, 4):
        m.save(step, model, opt, {"step": step}, {}, **how)
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [1, 2, 4]


def test_a_save_never_removes_the_checkpoint_it_wrote(tmp_path):
    # resumed from step 2 past a damaged step 4: saving step 3 with keep=1 must keep step 3
    m = manager(tmp_path, keep=1)
    run_saves(m, [4])
    run_saves(m, [3])
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 4]


def test_other_runs_are_moved_to_previous_not_deleted(tmp_path, caplog):
    old = manager(tmp_path, fingerprint="old")
    run_saves(old, [1, 2])
    digests = {p.name: ckpt.sha256_file(p) for p in (tmp_path / "step-00000002").iterdir()}
    (tmp_path / ".tmp-step-00000003-99").mkdir()  # an interrupted save
    new = manager(tmp_path, fingerprint="new")
    [moved] = new.prepare()
    assert new.prepare() == []  # nothing left to move: no second warning
    aside = tmp_path / "previous" / "old"
    assert moved.path == aside and moved.steps == (1, 2) and moved.fingerprint == "old"
    assert sorted(p.name for p in aside.iterdir()) == ["run.json", "step-00000001", "step-00000002"]
    assert {p.name: ckpt.sha256_file(p) for p in (aside / "step-00000002").iterdir()} == digests
    assert ckpt.step_folders(tmp_path) == [] and not (tmp_path / ".tmp-step-00000003-99").exists()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert str(aside) in warning and "init_from" in warning
    assert json.loads((aside / "run.json").read_text())["steps"] == [1, 2]
    assert new.resume_point() is None
    assert ckpt.resolve(aside).step == 2  # a previous run is a run folder: init_from can name it
    # the old run comes back and is moved aside again: the second generation gets its own folder
    run_saves(old, [1])
    new.prepare()
    assert sorted(p.name for p in aside.iterdir()) == ["run.json", "step-00000001", "step-00000002"]
    assert sorted(p.name for p in (tmp_path / "previous" / "old-2").iterdir()) == ["run.json", "step-00000001"]
    assert new.previous_runs() == [tmp_path / "previous" / "old-2", aside]  # newest first


def test_the_reason_names_the_identity_keys_that_changed(tmp_path, caplog):
    identity = {"optimizer": {"lr": 0.01, "beta1": 0.9}, "seed": 1}
    run_saves(ckpt.CheckpointManager(tmp_path, fingerprint="old", keep=2, is_main=True, identity=identity), [1])
    assert ckpt.latest(tmp_path).meta["identity"] == identity
    new = ckpt.CheckpointManager(tmp_path, fingerprint="new", keep=2, is_main=True,
                                 identity={"optimizer": {"lr": 0.005, "beta1": 0.9}, "seed": 1})
    with caplog.at_level("WARNING"):
        [moved] = new.prepare()
    assert moved.reason == "changed: optimizer.lr 0.01 -> 0.005"
    assert "optimizer.lr 0.01 -> 0.005" in caplog.text
    assert json.loads((moved.path / "run.json").read_text())["reason"] == moved.reason


def test_an_interrupted_move_is_completed_into_the_same_folder(tmp_path):
    run_saves(manager(tmp_path, fingerprint="old"), [1, 2])
    (tmp_path / "previous" / "old").mkdir(parents=True)  # killed after moving step 1: no run.json yet
    (tmp_path / "step-00000001").rename(tmp_path / "previous" / "old" / "step-00000001")
    [moved] = manager(tmp_path, fingerprint="new").prepare()
    assert moved.path == tmp_path / "previous" / "old" and moved.steps == (1, 2)


@pytest.mark.parametrize("case", ["taken back", "beyond max_steps", "without its curve"])
def test_a_run_kept_in_previous_is_taken_back_only_when_it_can_go_on(tmp_path, case):
    """Params changed and then changed back: the earlier run comes back from previous/, unless its newest
    checkpoint lies beyond this run's max_steps (a run is not shortened past steps it trained) or it was
    moved aside without its curve (the plots would then be another run's)."""
    (tmp_path / "curve.csv").write_text("step,loss\n1,2.0\n")
    run_saves(manager(tmp_path, fingerprint="run"), [4, 5])
    [moved] = manager(tmp_path, fingerprint="other").prepare()
    if case == "without its curve":
        (moved.path / "curve.csv").unlink()
    manager(tmp_path, fingerprint="run").prepare(max_steps=4 if case == "beyond max_steps" else 5)
    back = [c.step for c in ckpt.step_folders(tmp_path)]
    assert back == ([4, 5] if case == "taken back" else [])
    assert moved.path.is_dir() == (case != "taken back")


def test_turning_keep_best_off_drops_the_best_record(tmp_path):
    """With checkpoint.keep_best off nothing records or protects a best checkpoint any more: a best.json
    left in place would name a checkpoint the run no longer keeps as its best (export's checkpoint: best)."""
    m = ckpt.CheckpointManager(tmp_path, fingerprint="run", keep=2, is_main=True, keep_best=True)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    m.save(1, model, opt, {"step": 1}, {}, val_loss=2.0)
    assert ckpt.read_best(tmp_path)["step"] == 1
    ckpt.CheckpointManager(tmp_path, fingerprint="run", keep=2, is_main=True, keep_best=False).prepare()
    assert ckpt.read_best(tmp_path) is None


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_keep_last_k_never_removes_the_best_checkpoint_nor_a_protected_one(tmp_path, layout):
    """keep=1 with keep_best: the best checkpoint (step 2) and a protected step (3, a wsd
    run's last before decay) outlive every later save; a new best releases the old one."""
    m = ckpt.CheckpointManager(tmp_path, fingerprint="run", keep=1, is_main=True, keep_best=True)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    how = {"sharded": ALONE} if layout == "sharded" else {}
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0), (4, 2.5), (5, 2.5)):
        m.save(step, model, opt, {"step": step}, {}, val_loss=loss, protect=frozenset({3}), **how)
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [2, 3, 5]
    m.save(6, model, opt, {"step": 6}, {}, val_loss=0.5, protect=frozenset({3}), **how)
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 6] and m.best()["step"] == 6


def test_a_branch_kept_in_previous_is_never_taken_back_as_the_run(tmp_path):
    """A branch (a wsd run's decayed checkpoints, set aside when the run was lengthened) shares the run's
    fingerprint, but the run does not go on from it."""
    (tmp_path / "curve.csv").write_text("step,loss\n1,2.0\n")
    m = manager(tmp_path, fingerprint="run")
    run_saves(m, [4, 8])
    [branch] = m.prepare(branch=lambda step, meta: (4, "lengthened"))
    assert branch.steps == (8,) and (branch.path / "curve.csv").is_file()
    ckpt.discard(ckpt.step_folders(tmp_path))  # the run's own checkpoint is gone
    manager(tmp_path, fingerprint="run").prepare()
    assert ckpt.step_folders(tmp_path) == [] and branch.path.is_dir()


@pytest.mark.parametrize("best_step", [4, 8])
def test_a_branch_takes_best_json_only_when_its_best_checkpoint_goes_with_it(tmp_path, best_step):
    """A wsd run lengthened before its decay sets its decayed checkpoints aside as a branch. best.json
    goes with them when it names one of them; when it names a checkpoint the run keeps, it stays, so
    the run goes on with its best record (export's checkpoint: best) and keep-last-K still spares it."""
    (tmp_path / "curve.csv").write_text("step,loss\n1,2.0\n")
    m = ckpt.CheckpointManager(tmp_path, fingerprint="run", keep=2, is_main=True, keep_best=True)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters())
    for step in (4, 8):
        m.save(step, model, opt, {"step": step}, {}, val_loss=1.0 if step == best_step else 2.0)
    assert ckpt.read_best(tmp_path)["step"] == best_step
    [branch] = m.prepare(branch=lambda step, meta: (4, "lengthened"))
    assert branch.steps == (8,)
    if best_step == 4:
        assert ckpt.read_best(tmp_path)["step"] == 4 and not (branch.path / "best.json").exists()
    else:
        assert ckpt.read_best(tmp_path) is None and json.loads((branch.path / "best.json").read_text())["step"] == 8


def test_lowering_max_steps_below_the_newest_checkpoint_moves_the_run_aside(tmp_path, caplog):
    m = manager(tmp_path, fingerprint="run")
    run_saves(m, [4, 8])
    assert m.prepare(max_steps=8) == [] and m.prepare(max_steps=20) == []  # continuing, or at its end: kept
    with caplog.at_level("WARNING"):
        [moved] = m.prepare(max_steps=6)
    assert moved.path == tmp_path / "previous" / "run" and moved.steps == (4, 8)
    assert "schedule.max_steps was lowered to 6, below this run's newest checkpoint (step 8)" in caplog.text
    assert m.resume_point() is None


@pytest.mark.parametrize("keep_previous, kept", [(None, 3), (2, 2), (0, 0)])
def test_keep_previous_deletes_the_oldest_previous_runs_naming_them(tmp_path, caplog, keep_previous, kept):
    for i in range(3):
        run_saves(manager(tmp_path, fingerprint=f"run{i}"), [1])
        manager(tmp_path, fingerprint=f"run{i + 1}").prepare()
    assert [p.name for p in manager(tmp_path).previous_runs()] == ["run2", "run1", "run0"]
    run_saves(manager(tmp_path, fingerprint="run3"), [1])
    m = ckpt.CheckpointManager(tmp_path, fingerprint="run4", keep=2, is_main=True, keep_previous=keep_previous)
    with caplog.at_level("WARNING"):
        m.prepare()
    names = [p.name for p in m.previous_runs()]
    assert names == ["run3", "run2", "run1", "run0"][:kept if keep_previous is not None else 4]
    deleted = ["run3", "run2", "run1", "run0"][len(names):]
    for name in deleted:
        assert f"deleting the earlier run {tmp_path / 'previous' / name}" in caplog.text
    assert not [p for p in (tmp_path / "previous").iterdir() if p.name.startswith(".trash-")]


def test_keep_previous_never_deletes_the_run_a_warm_start_comes_from(tmp_path, caplog):
    for i in range(2):
        run_saves(manager(tmp_path, fingerprint=f"run{i}"), [1])
        manager(tmp_path, fingerprint=f"run{i + 1}").prepare()
    init = tmp_path / "previous" / "run0" / "step-00000001"
    m = ckpt.CheckpointManager(tmp_path, fingerprint="run9", keep=2, is_main=True, keep_previous=0)
    with caplog.at_level("WARNING"):
        m.prepare(in_use=init)
    assert m.previous_runs() == [tmp_path / "previous" / "run0"] and init.is_dir()
    assert "this run starts from" in caplog.text


def test_prepare_does_nothing_off_the_main_rank(tmp_path):
    run_saves(manager(tmp_path, fingerprint="old"), [1])
    other = manager(tmp_path, fingerprint="new", is_main=False)
    other.prepare()
    assert [c.step for c in ckpt.step_folders(tmp_path)] == [1]
    assert other.resume_point() is None  # another run's checkpoint is never resumed


# --------------------------------------------------------------------------- readers of a run's result


@pytest.fixture()
def damaged_run(tmp_path):
    """A run folder with an intact step 5 and a newest step 6 whose weights are damaged."""
    from tests.helpers import save_checkpoint, tiny_config, tiny_model

    model = tiny_model(tiny_config(64))
    save_checkpoint(tmp_path / "sft", model, step=5, meta={"final": True})
    c = save_checkpoint(tmp_path / "sft", model, step=6, meta={"final": True})
    flip_byte(c.path / "model.safetensors")
    return tmp_path / "sft", f"{c.path / 'model.safetensors'}: sha256 differs"


def test_evaluate_refuses_a_damaged_newest_checkpoint(damaged_run):
    from pipeline.evaluate import load_checkpoint_model

    folder, named = damaged_run
    with pytest.raises(ckpt.CheckpointError, match=named):
        load_checkpoint_model(folder, torch.device("cpu"))


def test_export_refuses_a_damaged_newest_checkpoint(damaged_run, tmp_path):
    from pipeline.export import export_model

    folder, named = damaged_run
    with pytest.raises(ckpt.CheckpointError, match=named):
        export_model(folder, tmp_path / "tokenizer.json", tmp_path / "export", card_info={})
    assert not (tmp_path / "export").exists()


def test_generate_refuses_a_damaged_checkpoint(damaged_run, tmp_path):
    from pipeline.model.generate import load_for_inference

    folder, named = damaged_run
    for path in (folder, folder / "step-00000006"):
        with pytest.raises(ckpt.CheckpointError, match=named):
            load_for_inference(path, tokenizer_path=tmp_path / "tokenizer.json")
    (folder / "step-00000006" / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="step-00000006/meta.json: missing"):
        load_for_inference(folder / "step-00000006", tokenizer_path=tmp_path / "tokenizer.json")


def test_sft_refuses_a_damaged_pretrain_checkpoint(damaged_run):
    from pipeline.training.sft import pretrained

    folder, named = damaged_run
    with pytest.raises(ckpt.CheckpointError, match=named):
        pretrained(folder)
    ckpt.discard([ckpt.Checkpoint(folder / "step-00000006", 6)])
    assert pretrained(folder).step == 5


# --------------------------------------------------------------------------- sharded (DCP) checkpoints

ALONE = Dist(0, 0, 1, torch.device("cpu"), None)  # one process, no process group


def sharded(folder, steps, model=None, keep=2):
    model = model or Tiny()
    opt = torch.optim.AdamW(model.parameters())
    model.out(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    m = manager(folder, keep=keep)
    for s in steps:
        m.save(s, model, opt, {"step": s}, {"note": "x"}, sharded=ALONE)
    return model, opt


def test_a_sharded_checkpoint_round_trips_without_a_process_group(tmp_path):
    model, opt = sharded(tmp_path, [1, 2, 3, 4])
    assert [c.step for c in ckpt.complete_checkpoints(tmp_path)] == [3, 4]  # keep-last-K
    c = ckpt.resolve(tmp_path)
    assert c.step == 4 and ckpt.is_sharded(c) and c.meta["format"] == "dcp" and c.meta["fingerprint"] == "a" * 16
    assert set(c.meta["files"]) == {".metadata", "__0_0.distcp", "trainer.pt"}
    fresh = Tiny()
    ckpt.load_model_weights(c, fresh)  # evaluate, export, generate and init-from read it like this
    assert torch.equal(fresh.emb.weight, model.emb.weight) and fresh.out.weight is fresh.emb.weight
    other = Tiny()
    other_opt = torch.optim.AdamW(other.parameters())
    assert manager(tmp_path).load(c, other, other_opt) == {"step": 4}
    assert torch.equal(other.emb.weight, model.emb.weight)
    for k, v in opt.state_dict()["state"][0].items():
        assert torch.equal(other_opt.state_dict()["state"][0][k], v), k
    assert other_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert ckpt.weights_id(c) == ckpt.weights_id(ckpt.resolve(c.path)) != ckpt.weights_id(ckpt.resolve(tmp_path / "step-00000003"))



def test_a_single_file_checkpoint_loads_into_an_fsdp_model_with_its_weights_and_adamw_state(tmp_path, monkeypatch):
    """A DDP run's checkpoint resumed or warm-started by an FSDP run: safetensors holds a tied
    weight once and optimizer.pt keys AdamW's state by position; both land in the DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from pipeline.training import distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    m = manager(tmp_path)
    source = run_saves(m, [1])
    saved = torch.load(tmp_path / "step-00000001" / "optimizer.pt", weights_only=True)
    d = distributed.init("cpu", need_group=True)
    try:
        model = fully_shard(Tiny(), mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters())
        assert m.load(ckpt.resolve(tmp_path), model, opt, d) == {"step": 1}
        assert torch.equal(model.emb.weight.full_tensor(), source.emb.weight) and model.out.weight is model.emb.weight
        assert torch.equal(opt.state[model.emb.weight]["exp_avg"].full_tensor(), saved["state"][0]["exp_avg"])
    finally:
        distributed.shutdown()


def test_load_training_state_verifies_before_it_loads(tmp_path):
    """init_from hands its checkpoint straight to load_training_state: a byte flipped
    after it was resolved is still caught, and nothing is loaded."""
    sharded(tmp_path, [1])
    c = ckpt.resolve(tmp_path)
    flip_byte(c.path / "__0_0.distcp")
    fresh = Tiny()
    before = fresh.emb.weight.clone()
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: sha256 differs"):
        ckpt.load_training_state(c, fresh, torch.optim.AdamW(fresh.parameters()), ALONE)
    assert torch.equal(fresh.emb.weight, before)


@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata", "trainer.pt"])
def test_a_damaged_shard_is_named_and_nothing_is_loaded(tmp_path, name, caplog):
    sharded(tmp_path, [1, 2])
    flip_byte(tmp_path / "step-00000002" / name)
    fresh = Tiny()
    before = fresh.emb.weight.clone()
    with pytest.raises(ckpt.CheckpointError, match=f"step-00000002/{name}: sha256 differs"):
        ckpt.load_model_weights(tmp_path / "step-00000002", fresh)
    assert torch.equal(fresh.emb.weight, before)
    assert manager(tmp_path).resume_point().step == 1  # resume falls back past it



@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_a_checkpoint_folder_of_any_name_resolves_to_the_step_its_meta_records(tmp_path, layout):
    """A checkpoint copied out of its run folder (``models/keep-this``) is still one
    checkpoint, of the step meta.json records, and still verified."""
    if layout == "sharded":
        sharded(tmp_path / "run", [7])
    else:
        make(tmp_path / "run", 7)
    os.replace(tmp_path / "run" / "step-00000007", tmp_path / "keep-this")
    c = ckpt.resolve(tmp_path / "keep-this")
    assert c.step == 7 and c.path == tmp_path / "keep-this" and ckpt.is_sharded(c) == (layout == "sharded")
    flip_byte(tmp_path / "keep-this" / "trainer.pt")
    with pytest.raises(ckpt.CheckpointError, match=r"keep-this/trainer.pt: sha256 differs"):
        ckpt.resolve(tmp_path / "keep-this")


def test_a_sharded_checkpoint_without_its_index_is_damaged_not_a_file_layout(tmp_path):
    sharded(tmp_path, [1])
    (tmp_path / "step-00000001" / ".metadata").unlink()
    assert ckpt.latest(tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata: missing, though meta.json records it"):
        ckpt.resolve(tmp_path)


def test_a_shard_that_meta_json_does_not_record_is_damage(tmp_path):
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    (c / "__1_0.distcp").write_bytes((c / "__0_0.distcp").read_bytes())
    with pytest.raises(ckpt.CheckpointError, match=r"__1_0\.distcp: not recorded in meta.json"):
        ckpt.load_model_weights(c, Tiny())



def rerecord(checkpoint, **renames):
    """meta.json's ``files`` with each entry ``old=new`` renamed (new None: dropped), as
    a hand edit or a lost rank's record would leave it; files named are renamed too."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    for old, new in renames.items():
        info = meta["files"].pop(old)
        if new is not None:
            meta["files"][new] = info
            (checkpoint / old).rename(checkpoint / new)
        else:
            (checkpoint / old).unlink()
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_dcp_files_in_a_single_file_checkpoint_are_damage_not_loaded(tmp_path):
    """A .metadata makes a folder load as sharded (is_sharded): in a single-file
    checkpoint whose meta.json records no DCP file, its weights would load unverified."""
    make(tmp_path / "a", 1)
    make(tmp_path / "a", 2)
    sharded(tmp_path / "s", [1], model=Tiny())
    c, s = tmp_path / "a" / "step-00000002", tmp_path / "s" / "step-00000001"
    for name in (".metadata", "__0_0.distcp"):
        (c / name).write_bytes((s / name).read_bytes())
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000002/\.metadata: not recorded in meta.json, so it "
                                                   r"cannot be verified \(checkpoint step-00000002 is damaged\)$"):
        ckpt.load_model_weights(c, Tiny())
    (c / ".metadata").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"__0_0\.distcp: not recorded in meta.json"):
        ckpt.verify(c)
    with pytest.raises(ckpt.CheckpointError, match="not recorded in meta.json"):
        ckpt.resolve(tmp_path / "a")  # the run's result is refused, not taken from step 1
    ckpt.verify(tmp_path / "a" / "step-00000001")


def test_an_index_that_names_a_shard_meta_json_does_not_record_is_damage(tmp_path):
    """A rank's shard lost with its record (meta.json records __1_0, the index reads
    __0_0): damage found when verified, so a resume falls back, not a DCP traceback."""
    sharded(tmp_path, [1, 2])
    c = tmp_path / "step-00000002"
    rerecord(c, **{"__0_0.distcp": "__1_0.distcp"})
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000002/\.metadata: names the shard file\(s\) "
                                                   r"__0_0\.distcp, which meta.json does not record"):
        ckpt.verify(c)
    assert manager(tmp_path).resume_point().step == 1


def test_a_sharded_meta_json_that_records_no_shard_is_damage(tmp_path):
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    rerecord(c, **{"__0_0.distcp": None})
    with pytest.raises(ckpt.CheckpointError, match=r"meta.json: records no shard file \(__<rank>_0\.distcp\)"):
        ckpt.verify(c)


def test_a_sharded_checkpoint_of_another_shape_names_the_tensor_in_one_line(tmp_path):
    """DCP's CheckpointException prints a traceback per rank; the cause is what is said."""
    model, _ = sharded(tmp_path, [1])
    small = Tiny(n=4)
    with pytest.raises(ckpt.CheckpointError) as err:
        manager(tmp_path).load(ckpt.resolve(tmp_path), small, torch.optim.AdamW(small.parameters()))
    assert "\n" not in str(err.value)
    assert str(err.value).endswith("cannot load the sharded checkpoint (ValueError: Size mismatch between saved "
                                   "torch.Size([10, 8]) and current: torch.Size([10, 4]) for model.emb.weight)")



def test_a_sharded_save_after_a_kill_sweeps_the_killed_saves_leftovers(tmp_path):
    """A SIGKILL mid-save leaves .tmp-* (half-written shards) and .trash-* folders;
    the next sharded save removes them and leaves only whole checkpoints."""
    sharded(tmp_path, [1])
    for name in (".tmp-step-00000002-123", ".trash-step-00000001-456"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"half")
    sharded(tmp_path, [2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000002"]


def test_a_sharded_save_whose_ranks_did_not_record_every_file_fails_and_leaves_no_checkpoint(tmp_path, monkeypatch):
    """A shard file no rank hashed (a rank's record lost) would make a checkpoint that
    never verifies: the save fails in one line and the folder keeps the last good one."""
    sharded(tmp_path, [1])
    write = ckpt._write_shards
    monkeypatch.setattr(ckpt, "_write_shards", lambda tmp, state, d: (write(tmp, state, d), {})[1])
    with pytest.raises(ckpt.CheckpointError, match=r"holds \['.metadata', '__0_0.distcp', 'trainer.pt'\], but "
                                                   r"the ranks recorded \['.metadata', 'trainer.pt'\]"):
        sharded(tmp_path, [2])
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert manager(tmp_path).resume_point().step == 1


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_metadata_index_that_would_run_code_is_refused(tmp_path):
    """DCP itself unpickles .metadata with plain pickle; ours admits only DCP's
    classes, so even a file whose sha256 meta.json vouches for runs nothing."""
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    marker = tmp_path / "ran"
    (c / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    meta = json.loads((c / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": (c / ".metadata").stat().st_size, "sha256": sha256_file(c / ".metadata")}
    (c / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="global posix.system is not allowed"):
        ckpt.load_model_weights(c, Tiny())
    assert not marker.exists()


def _stack_global(module, name, arg):
    """A protocol-4 pickle calling ``module.name(arg)``, where ``name`` may be a
    dotted path (STACK_GLOBAL resolves one attribute after another); no Pickler
    writes that for a function, an attacker does."""
    def text(x):
        return b"\x8c" + bytes([len(x.encode())]) + x.encode()  # SHORT_BINUNICODE
    return b"\x80\x04" + text(module) + text(name) + b"\x93" + text(arg) + b"\x85R."  # STACK_GLOBAL, TUPLE1, REDUCE



@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_non_tensor_value_in_a_shard_that_would_run_code_is_refused(tmp_path):
    """DCP reads a shard's non-tensor values (AdamW's hyperparameters) with
    torch.load(weights_only=False); ours with weights_only=True, so a shard whose
    sha256 meta.json vouches for still runs nothing when a run resumes from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    marker = tmp_path / "ran"
    model_state, optim_state = get_state_dict(model, opt)
    optim_state["param_groups"][0]["lr"] = _RunsCode(marker)
    for p in c.iterdir():
        if p.name != "meta.json" and p.name != "trainer.pt":
            p.unlink()
    dcp.save({"model": model_state, "optim": optim_state}, no_dist=True,
             storage_writer=dcp.FileSystemWriter(c, single_file_per_rank=True))
    meta = json.loads((c / "meta.json").read_text())
    meta["files"].update({n: {"bytes": (c / n).stat().st_size, "sha256": sha256_file(c / n)}
                          for n in (".metadata", "__0_0.distcp")})
    (c / "meta.json").write_text(json.dumps(meta))
    other = Tiny()
    with pytest.raises(ckpt.CheckpointError, match=r"cannot load the sharded checkpoint \(UnpicklingError: "):
        manager(tmp_path).load(ckpt.resolve(tmp_path), other, torch.optim.AdamW(other.parameters()))
    assert not marker.exists()



def test_a_sharded_checkpoint_of_another_shape_is_named_once_by_load_model_weights(tmp_path):
    """evaluate/export/generate read through load_model_weights: DCP's own cause, the
    checkpoint named once, not wrapped in a second 'do not fit' around it."""
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_model_weights(c, Tiny(n=4))
    assert str(err.value) == (f"{c}: cannot load the sharded checkpoint (ValueError: Size mismatch between saved "
                              "torch.Size([10, 8]) and current: torch.Size([10, 4]) for model.emb.weight)")


@pytest.mark.parametrize("name", ["os.system", "torch.os.system", "torch"])  # torch: a module, not a class of DCP's
def test_a_metadata_index_that_reaches_a_module_dcp_imports_is_refused(tmp_path, name):
    """DCP's metadata module imports os and torch: a dotted name through them
    must not pass for one of its classes."""
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    marker = tmp_path / "ran"
    (c / ".metadata").write_bytes(_stack_global("torch.distributed.checkpoint.metadata", name, f"touch {marker}"))
    meta = json.loads((c / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": (c / ".metadata").stat().st_size, "sha256": sha256_file(c / ".metadata")}
    (c / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=f"global torch.distributed.checkpoint.metadata.{name} is not allowed"):
        ckpt.load_model_weights(c, Tiny())
    assert not marker.exists()


class _EnumsByName(pickle.Pickler):
    """Pickles enum members as early Python 3.11 releases (3.11.2) do: ``getattr(cls, name)``."""

    def reducer_override(self, obj):
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def repickle_metadata(checkpoint, pickler=_EnumsByName, obj=None):
    """Writes ``obj`` (default: the checkpoint's own Metadata) as its .metadata
    with ``pickler``, and records the new file in meta.json (a vouched-for file)."""
    path = checkpoint / ".metadata"
    obj = ckpt.read_dcp_metadata(checkpoint) if obj is None else obj
    buf = io.BytesIO()
    pickler(buf).dump(obj)  # the default protocol, as DCP writes it
    path.write_bytes(buf.getvalue())
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    (checkpoint / "meta.json").write_text(json.dumps(meta))


def test_a_sharded_checkpoint_written_by_python_3_11_2_loads(tmp_path):
    """Debian 12's Python 3.11.2 pickles DCP's memory-format enum by name, through
    builtins.getattr, which the unpickler refused: an FSDP run there could not
    resume, evaluate or export its own checkpoints."""
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"
    expected = Tiny()
    ckpt.load_model_weights(c, expected)
    repickle_metadata(c)
    assert b"getattr" in (c / ".metadata").read_bytes()
    got = Tiny()
    ckpt.load_model_weights(c, got)
    assert all(torch.equal(a, b) for a, b in zip(expected.state_dict().values(), got.state_dict().values()))


def test_getattr_in_a_metadata_index_gives_only_an_enum_member(tmp_path):
    sharded(tmp_path, [1])
    c = tmp_path / "step-00000001"

    class Marker:
        pass

    class MethodOfAnAdmittedClass(pickle.Pickler):
        def reducer_override(self, obj):
            return (getattr, (PosixPath, "write_text")) if isinstance(obj, Marker) else NotImplemented

    repickle_metadata(c, MethodOfAnAdmittedClass, obj=[Marker()])
    with pytest.raises(ckpt.CheckpointError, match=r"getattr\(PosixPath, 'write_text'\) is not allowed"):
        ckpt.load_model_weights(c, Tiny())


def test_a_sharded_checkpoint_of_another_model_is_one_line(tmp_path):
    sharded(tmp_path, [1])
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000001: the weights do not fit the model its meta.json "
                                                   r"describes \(missing \['bias', 'weight'\], unexpected "
                                                   r"\['emb.weight', 'out.weight'\]\)$"):
        ckpt.load_model_weights(tmp_path / "step-00000001", torch.nn.Linear(3, 3))


def test_a_meta_json_with_an_invalid_or_no_model_is_one_line(tmp_path):
    """meta.json is not hashed: its model entry is checked when the checkpoint is verified."""
    from pipeline.model.transformer import ModelConfig
    from tests.helpers import tiny_config, tiny_model
    from tests.helpers import save_checkpoint as save_with_model

    c = save_with_model(tmp_path / "a", tiny_model(tiny_config(64)), step=5)
    assert ckpt.model_config(ckpt.resolve(tmp_path / "a")) == ModelConfig(**c.meta["model"])
    meta = json.loads((c.path / "meta.json").read_text())
    meta["model"]["n_kv_head"] = 3  # n_head 4 is not a multiple
    (c.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"step-00000005/meta.json: records an invalid model \(.*"
                                                   r"must be divisible by n_kv_head.*\) \(checkpoint step-00000005 is"):
        ckpt.verify(c.path)
    del meta["model"]
    (c.path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"meta.json: records no model configuration"):
        ckpt.model_config(ckpt.resolve(tmp_path / "a"))


@pytest.mark.parametrize("layout", ["plain", "sharded"])
def test_weights_that_do_not_fit_the_model_meta_json_describes_are_one_line(tmp_path, layout):
    """A meta.json edited by hand (one layer more) builds a model its weights do not fill: one line, no
    traceback from torch or safetensors."""
    from pipeline.model.transformer import ModelConfig, Transformer
    from tests.helpers import tiny_config, tiny_model
    from tests.helpers import save_checkpoint as save_with_model

    if layout == "plain":
        c = save_with_model(tmp_path / "a", tiny_model(tiny_config(64)), step=5)
    else:
        model = tiny_model(tiny_config(64))
        opt = torch.optim.AdamW(model.parameters())
        manager(tmp_path / "a").save(5, model, opt, {"step": 5}, {"model": tiny_config(64).to_dict()}, sharded=ALONE)
        c = ckpt.resolve(tmp_path / "a")
    meta = json.loads((c.path / "meta.json").read_text())
    meta["model"]["n_layer"] += 1
    (c.path / "meta.json").write_text(json.dumps(meta))
    last = ckpt.resolve(tmp_path / "a")
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_model_weights(last, Transformer(ModelConfig(**last.meta["model"])))
    assert "\n" not in str(err.value)
    assert "the weights do not fit the model its meta.json describes" in str(err.value)
    assert "layers.2" in str(err.value)  # names what is missing


# --------------------------------------------------------------------------- a full disk


def trained(tie=True):
    model = Tiny(tie=tie)
    opt = torch.optim.AdamW(model.parameters())
    model.out(model.emb(torch.tensor([1, 2]))).sum().backward()
    opt.step()
    return model, opt


def test_state_bytes_is_a_lower_bound_that_counts_tied_weights_once(tmp_path):
    model, opt = trained()
    # the 10x8 fp32 weight once, AdamW's two moments of it, and its step count
    assert ckpt.state_bytes(model, opt) == 3 * 320 + 4
    assert ckpt.state_bytes(*trained(tie=False)) == 2 * (3 * 320 + 4)
    c = ckpt.save(tmp_path, 1, model, opt, {"step": 1}, {}, keep=1)
    assert ckpt.state_bytes(model, opt) < sum(p.stat().st_size for p in c.path.iterdir())


def test_a_checkpoint_that_cannot_fit_is_refused_before_any_write(tmp_path, monkeypatch):
    m = manager(tmp_path, keep=2)
    model, opt = trained()
    m.save(1, model, opt, {"step": 1}, {})
    need = ckpt.state_bytes(model, opt)
    monkeypatch.setattr(ckpt, "free_bytes", lambda path: need - 1)
    monkeypatch.setattr(ckpt, "save_model", lambda *a: pytest.fail("a write began"))
    with pytest.raises(ckpt.DiskFullError) as err:
        m.save(2, model, opt, {"step": 2}, {})
    assert str(err.value) == (  # 963 and 964 bytes
        f"no space left on the device for checkpoint step 2 in {tmp_path} (1 kB free on "
        f"{ckpt.mount_point(tmp_path)}; a checkpoint takes at least 1 kB, and checkpoint.keep = 2 are kept); "
        f"free some space, or lower checkpoint.keep, and run the stage again: it resumes from step 1 "
        f"({tmp_path / 'step-00000001'}), which is intact")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]


def test_a_save_the_disk_fills_up_under_is_one_line_and_the_last_checkpoint_stays(tmp_path, monkeypatch):
    from pipeline import files

    m = manager(tmp_path, keep=2)
    model, opt = trained()
    m.save(1, model, opt, {"step": 1}, {})
    real_save = torch.save

    def fills_the_disk(obj, path):  # as torch.save fails on a full disk: a partial file, no errno
        ckpt.Path(path).write_bytes(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 433472 vs 433360")

    monkeypatch.setattr(ckpt.torch, "save", fills_the_disk)
    monkeypatch.setattr(files, "free_bytes", lambda path: 0)  # what the failed write left
    with pytest.raises(ckpt.DiskFullError) as err:
        m.save(2, model, opt, {"step": 2}, {})
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert str(err.value).startswith(f"no space left on the device for checkpoint step 2 in {tmp_path} (")
    assert str(err.value).endswith(f"it resumes from step 1 ({tmp_path / 'step-00000001'}), which is intact")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    ckpt.verify(ckpt.latest(tmp_path))
