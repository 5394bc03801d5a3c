"""Pretrain from ``init_from`` (pipeline/training/pretrain.py), in process on one
rank: planning (what is refused, what is ignored) and training from a Hugging
Face folder or warm-starting from a checkpoint of ours. Random-init training is
in test_trainer.py; the torchrun paths are in tests/stages/test_pretrain.py."""

import csv
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import parse_section
from pipeline.model import hf_adapter
from pipeline.training import checkpoint as ckpt
from pipeline.training.init import InitError
from pipeline.data.shards import DataError, PackedRows
from pipeline.errors import StageError
from pipeline.training.pretrain import PretrainConfig, plan, prepare_pretrain, run_pretrain, unigram_entropy
from tests.hf_models import save_tiny_hf_folder
from tests.helpers import train_params, write_packed

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = train_params({}, precision="fp32", micro_batch_size=4, max_steps=4, warmup_steps=1, lr=1e-2, min_lr=1e-3,
                    log_every=1, eval_every=4, eval_rows=8, checkpoint_every=2, keep_checkpoints=2, track=False,
                    peak_flops=1e15)
VOCAB = 534  # the qwen2 fixture tokenizer's size; the model embeds 640


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Qwen2 model folder with its tokenizer, and packed data made with that tokenizer."""
    root = tmp_path_factory.mktemp("hf")
    folder = save_tiny_hf_folder("qwen2", root / "qwen2")
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    write_packed(root / "packed", vocab=VOCAB, seq_len=32, n_docs=200, tokenizer=folder / "tokenizer.json")
    return folder, root / "packed"


def cfg(**kw):
    return parse_section(PretrainConfig, train_params(BASE, **kw), "pretrain")


def run(tmp_path, packed, name="run", **kw):
    out = tmp_path / name
    return run_pretrain(cfg(**kw), packed, out / "models", out / "plots.csv")


def refused(c, packed, out) -> str:
    with pytest.raises(InitError) as err:
        plan(c, packed, out)
    assert "\n" not in str(err.value)
    return str(err.value)


def losses(path):
    with open(path, newline="") as f:
        return [r["loss"] for r in csv.DictReader(f)]


def hf_weights(folder):
    return hf_adapter.load_hf_model(folder)[1].state_dict()


def saved(checkpoint):
    return load_file(str(checkpoint.path / "model.safetensors"))


# --------------------------------------------------------------------------- planning


def test_the_architecture_comes_from_the_initial_model_and_model_keys_are_ignored_with_a_warning(hf, tmp_path, caplog):
    folder, packed = hf
    expected = hf_adapter.config_from_hf(json.loads((folder / "config.json").read_text()))
    c = cfg(init_from=str(folder), model={"preset": "tiny", "d_model": 256})
    with caplog.at_level("WARNING", logger="pipeline.training"):
        model_cfg, _, meta, init = plan(c, packed, tmp_path / "models", warn=True)
    assert model_cfg == expected == init.model and model_cfg.d_model == 64
    [warning] = [r.getMessage() for r in caplog.records if "are ignored" in r.getMessage()]
    assert f"the architecture comes from {folder}, so pretrain.model key(s) d_model, preset are ignored" in warning
    assert meta["hf_config"] == json.loads((folder / "config.json").read_text())
    caplog.clear()
    with caplog.at_level("WARNING", logger="pipeline.training"):
        plan(cfg(init_from=str(folder)), packed, tmp_path / "models", warn=True)  # no model keys: nothing to say
        plan(cfg(init_from=str(folder), model={"preset": "mini"}), packed, tmp_path / "models", warn=True)  # default
        plan(c, packed, tmp_path / "models")  # every rank plans too: only the launcher (warn=True) says it
    assert "are ignored" not in caplog.text


def test_a_model_without_tokenizer_json_is_a_warning_of_the_launcher_alone(hf, tmp_path, caplog):
    folder, packed = hf
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    with caplog.at_level("WARNING", logger="pipeline.training"):
        plan(cfg(init_from=str(bare)), packed, tmp_path / "models", warn=True)
        plan(cfg(init_from=str(bare)), packed, tmp_path / "models")  # every rank plans too: only the launcher says it
    [warning] = [r.getMessage() for r in caplog.records if "tokenizer.json" in r.getMessage()]
    assert warning.startswith(f"{bare} ships no tokenizer.json, so the pairing with data/tokenizer cannot be checked")


def test_without_init_from_the_model_section_builds_the_model(hf, tmp_path):
    _, packed = hf
    model_cfg, _, meta, init = plan(cfg(model={"preset": "tiny"}), packed, tmp_path / "models")
    assert init is None and model_cfg.vocab_size == VOCAB and model_cfg.family == "llama"
    assert "hf_config" not in meta


def test_max_steps_0_without_init_from_is_one_line(hf, tmp_path):
    _, packed = hf
    message = refused(cfg(max_steps=0, warmup_steps=0), packed, tmp_path / "models")
    assert "max_steps 0" in message and "init_from is null" in message and "set pretrain.init_from" in message


def test_init_optimizer_needs_a_checkpoint_of_ours(hf, tmp_path):
    folder, packed = hf
    message = refused(cfg(init_from=str(folder), init_optimizer=True), packed, tmp_path / "models")
    assert f"{folder} is a Hugging Face model, which has no optimizer state" in message
    message = refused(cfg(init_optimizer=True), packed, tmp_path / "models")
    assert "init_optimizer needs init_from" in message


@pytest.mark.parametrize("blank", ["", "  "])
def test_an_empty_init_from_is_refused_naming_the_key_not_read_as_the_project_root(blank):
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match=r"pretrain.init_from: .*is empty; null starts from a random init"):
        cfg(init_from=blank)


def test_the_data_identity_covers_both_splits(tmp_path):
    """A run resumed on another val split would mix val losses of two datasets: the val shards are part of the
    data identity (hence of the run's), as the train shards are."""
    packed = write_packed(tmp_path / "packed")
    before = plan(cfg(model={"preset": "tiny"}), packed, tmp_path / "models")[1]
    for split in ("val", "train"):
        manifest = json.loads((packed / "manifest.json").read_text())
        manifest["splits"][split]["shards"][0]["sha256"] = "0" * 64
        (packed / "manifest.json").write_text(json.dumps(manifest))
        after = plan(cfg(model={"preset": "tiny"}), packed, tmp_path / "models")[1]
        assert after != before, split
        before = after

def test_unigram_entropy_counts_the_predicted_tokens():
    """Each row's first token is never a target: rows 0 1 1 and 2 1 1 predict
    only token 1, so the best context-free loss is 0."""

    class Rows:
        def iter_input_ids(self):
            yield np.array([[0, 1, 1]])
            yield np.array([[2, 1, 1], [5, 1, 3]])

    assert unigram_entropy(Rows()) == pytest.approx(-(5 / 6 * math.log(5 / 6) + 1 / 6 * math.log(1 / 6)))


def test_pack_seq_len_above_the_models_context_is_one_line(tmp_path):
    folder = save_tiny_hf_folder("llama", tmp_path / "llama", max_position_embeddings=32)
    for seq_len in (31, 32):  # up to the model's context: fine
        write_packed(tmp_path / f"packed{seq_len}", vocab=VOCAB, seq_len=seq_len, n_docs=40,
                     tokenizer=folder / "tokenizer.json")
        assert plan(cfg(init_from=str(folder)), tmp_path / f"packed{seq_len}", tmp_path / "models")[0].max_seq_len == 32
    write_packed(tmp_path / "packed33", vocab=VOCAB, seq_len=33, n_docs=40, tokenizer=folder / "tokenizer.json")
    message = refused(cfg(init_from=str(folder)), tmp_path / "packed33", tmp_path / "models")
    assert f"pack.seq_len 33 exceeds the max_seq_len 32 of {folder}" in message


def test_a_model_shape_that_cannot_be_built_is_one_line(hf, tmp_path):
    _, packed = hf
    with pytest.raises(StageError) as err:
        plan(cfg(model={"preset": "tiny", "n_head": 4, "n_kv_head": 3, "d_model": 30}), packed, tmp_path / "models")
    assert str(err.value) == ("pretrain.model (preset tiny, with its overrides): d_model (30) must be divisible by "
                              "n_head (4); n_head (4) must be divisible by n_kv_head (3), so that each kv head serves "
                              "a whole group of query heads")


def test_a_model_max_seq_len_below_pack_seq_len_is_one_line_naming_both(hf, tmp_path):
    _, packed = hf  # rows of 32 tokens
    assert plan(cfg(model={"preset": "tiny", "max_seq_len": 32}), packed, tmp_path / "models")[0].max_seq_len == 32
    with pytest.raises(StageError) as err:
        plan(cfg(model={"preset": "tiny", "max_seq_len": 31}), packed, tmp_path / "models")
    assert str(err.value) == ("pack.seq_len 32 exceeds pretrain.model.max_seq_len 31; raise it (null follows "
                              "pack.seq_len) or lower pack.seq_len")


def test_the_launcher_refuses_a_batch_the_train_split_cannot_fill(hf, tmp_path):
    """Before torchrun starts: every rank would refuse it, after seconds of start-up."""
    _, packed = hf
    rows = len(PackedRows(packed / "train"))
    fits = dict(model={"preset": "tiny"}, micro_batch_size=rows // 2, grad_accum_steps=1, nproc_per_node=2)
    prepare_pretrain(cfg(**fits), packed, tmp_path / "models")
    for too_many in (dict(fits, grad_accum_steps=2), dict(fits, nproc_per_node=3),
                     dict(fits, micro_batch_size="auto", grad_accum_steps=rows // 16 + 1)):  # auto: 16 rows each
        with pytest.raises(DataError) as err:
            prepare_pretrain(cfg(**too_many), packed, tmp_path / "models")
        assert f"but the train split has only {rows}; lower them or add data" in str(err.value)
    assert not (tmp_path / "models").exists()


@pytest.mark.parametrize("compute, message", [
    ({"attention": "flex"}, "attention flex trains on CUDA only"),
    ({"attention": "varlen"}, "attention varlen needs a CUDA device"),
    ({"device": "cuda"}, "device 'cuda' was asked for, but torch"),
])
def test_the_launcher_refuses_a_device_or_attention_this_machine_cannot_train_with(hf, tmp_path, compute, message):
    """Before torchrun starts: every rank would refuse it, in a rank's line after torchrun's start-up."""
    if torch.cuda.is_available():
        pytest.skip("the refusals are those of a machine without CUDA")
    _, packed = hf
    params = train_params(BASE, model={"preset": "tiny"})
    params["compute"] = {**params.get("compute", {}), **compute}
    with pytest.raises(StageError, match=message):
        prepare_pretrain(parse_section(PretrainConfig, params, "pretrain"), packed, tmp_path / "models")
    assert not (tmp_path / "models").exists()


def test_the_launcher_refuses_fsdp_in_fp16_before_any_rank_starts(hf, tmp_path):
    """Every rank would refuse it too, but only after torchrun's start-up, in a rank's line."""
    _, packed = hf
    c = cfg(model={"preset": "tiny"}, precision="fp16", parallelism="fsdp")
    with pytest.raises(StageError, match=r"^compute.parallelism fsdp trains in bf16 or fp32, not fp16") as err:
        prepare_pretrain(c, packed, tmp_path / "models")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "models").exists()
    prepare_pretrain(cfg(model={"preset": "tiny"}, precision="fp16"), packed, tmp_path / "models")  # ddp: fine


def test_data_made_with_another_tokenizer_is_refused_before_training(hf, tmp_path):
    folder, _ = hf
    write_packed(tmp_path / "packed", vocab=64, n_docs=40)  # our own (synthetic) tokenizer
    message = refused(cfg(init_from=str(folder)), tmp_path / "packed", tmp_path / "models")
    assert f"set tokenizer.source: {folder}" in message
    assert not (tmp_path / "models").exists()


# --------------------------------------------------------------------------- training from a Hugging Face model


def test_max_steps_0_passes_the_hugging_face_model_through(hf, tmp_path):
    folder, packed = hf
    m = run(tmp_path, packed, init_from=str(folder), max_steps=0, warmup_steps=0)
    assert m["steps"] == 0 and m["final_loss"] is None and math.isfinite(m["val_loss"])
    [c] = ckpt.complete_checkpoints(tmp_path / "run" / "models")
    assert c.step == 0 and c.meta["final"] is True
    assert c.meta["hf_config"] == json.loads((folder / "config.json").read_text())
    assert c.meta["hf_generation_config"] == json.loads((folder / "generation_config.json").read_text())
    assert c.meta["tokenizer_sha256"] == json.loads((packed / "manifest.json").read_text())["tokenizer_sha256"]
    assert c.meta["init"]["id"].startswith("hf:")
    weights, original = saved(c), hf_weights(folder)
    assert weights.keys() == original.keys() - {"tok_embeddings.weight"}  # tied: stored once, as output.weight
    for k, v in weights.items():
        assert torch.equal(v, original[k]), k


def test_a_few_steps_from_a_hugging_face_model_train_and_keep_its_config(hf, tmp_path):
    folder, packed = hf
    m = run(tmp_path, packed, init_from=str(folder), max_steps=4)
    assert m["steps"] == 4 and m["resumed_from_step"] == 0
    curve = [float(x) for x in losses(tmp_path / "run" / "plots.csv")]
    assert len(curve) == 4 and all(math.isfinite(x) for x in curve) and math.isfinite(m["val_loss"])
    last = ckpt.latest(tmp_path / "run" / "models")
    assert last.step == 4 and last.meta["final"] and last.meta["hf_config"]["architectures"] == ["Qwen2ForCausalLM"]
    original = hf_weights(folder)
    assert any(not torch.equal(v, original[k]) for k, v in saved(last).items())  # it trained
    # it started from the model's weights: a run warm-started from the passed-through model (the same
    # weights, the same batches) has the same first loss, string-exact
    run(tmp_path, packed, "zero", init_from=str(folder), max_steps=0, warmup_steps=0)
    passed = ckpt.latest(tmp_path / "zero" / "models").path
    run(tmp_path, packed, "warm", init_from=str(passed), max_steps=1, warmup_steps=0)
    assert losses(tmp_path / "warm" / "plots.csv")[0] == losses(tmp_path / "run" / "plots.csv")[0]
    # a rerun resumes the run (same identity), it does not start again from the model; the ignored
    # pretrain.model keys are no part of the identity either, so switching setups does not restart it
    assert run(tmp_path, packed, init_from=str(folder), max_steps=4)["resumed_from_step"] == 4
    m = run(tmp_path, packed, init_from=str(folder), max_steps=4, model={"preset": "small", "d_model": 96})
    assert m["resumed_from_step"] == 4 and m["moved_aside"] == 0


def test_a_replaced_model_folder_starts_a_new_run(hf, tmp_path):
    folder, packed = hf
    copy = shutil.copytree(folder, tmp_path / "model")
    run(tmp_path, packed, init_from=str(copy), max_steps=2)
    save_tiny_hf_folder("qwen2", tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "model.safetensors", copy / "model.safetensors")  # same path, other weights
    m = run(tmp_path, packed, init_from=str(copy), max_steps=2)
    assert m["resumed_from_step"] == 0 and m["moved_aside"] == 1


# --------------------------------------------------------------------------- warm starts from our checkpoints


def test_init_from_this_stages_live_checkpoints_is_refused_but_a_previous_run_works(hf, tmp_path):
    folder, packed = hf
    out = tmp_path / "run" / "models"
    run(tmp_path, packed, init_from=str(folder), max_steps=4)
    for live in (out, out / "step-00000004", out / "step-00000002"):
        for spelled in (str(live), str(live) + "/", os.path.relpath(live)):
            message = refused(cfg(init_from=spelled, lr=5e-3), packed, out)
            assert "names this stage's own live checkpoints" in message and f"{out}/previous/<run-id>/step-N" in message
    assert [c.step for c in ckpt.complete_checkpoints(out)] == [2, 4]  # nothing was moved or deleted
    # a changed run moves the first aside, to previous/<id>/: from there it can start a run
    run(tmp_path, packed, init_from=str(folder), max_steps=4, lr=5e-3)
    [aside] = (out / "previous").iterdir()
    donor = ckpt.resolve(aside / "step-00000004")
    m = run(tmp_path, packed, init_from=str(donor.path), max_steps=0, warmup_steps=0)
    assert m["steps"] == 0
    last = ckpt.latest(out)
    assert last.step == 0 and last.meta["init"]["from"] == str(donor.path)
    assert all(torch.equal(saved(last)[k], v) for k, v in saved(donor).items())
    assert last.meta["hf_config"] == donor.meta["hf_config"]  # still exports as the family it came from


def test_warm_start_from_a_step_folder_with_and_without_its_optimizer_moments(hf, tmp_path):
    folder, packed = hf
    run(tmp_path, packed, "donor", init_from=str(folder), max_steps=4)
    donor = ckpt.resolve(tmp_path / "donor" / "models" / "step-00000004")
    plain = run(tmp_path, packed, "plain", init_from=str(donor.path), max_steps=3)
    moments = run(tmp_path, packed, "moments", init_from=str(donor.path), init_optimizer=True, max_steps=3)
    assert plain["resumed_from_step"] == moments["resumed_from_step"] == 0
    a, b = losses(tmp_path / "plain" / "plots.csv"), losses(tmp_path / "moments" / "plots.csv")
    assert len(a) == len(b) == 3
    assert a[0] == b[0]  # the same starting weights, so the same first loss
    assert a[1:] != b[1:]  # but a different first update: AdamW's moments and step count came along
    for name, optimizer in (("plain", False), ("moments", True)):
        last = ckpt.latest(tmp_path / name / "models")
        assert last.meta["init"]["from"] == str(donor.path) and last.meta["init"]["optimizer"] is optimizer
        assert last.meta["hf_config"]["architectures"] == ["Qwen2ForCausalLM"]
    # the starting weights are the donor's: max_steps 0 passes them through
    run(tmp_path, packed, "zero", init_from=str(donor.path), max_steps=0, warmup_steps=0)
    passed = saved(ckpt.latest(tmp_path / "zero" / "models"))
    assert all(torch.equal(passed[k], v) for k, v in saved(donor).items())
    # a warm start may not bring another model shape: it is the donor's architecture, whatever pretrain.model says
    model_cfg = plan(cfg(init_from=str(donor.path), model={"preset": "tiny"}), packed, tmp_path / "x")[0]
    assert model_cfg.d_model == 64 and model_cfg.family == "qwen2"
