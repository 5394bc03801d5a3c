"""pipeline/training/sft.py: the sft stage reuses the pretrain trainer, starting from
pretrain's final checkpoint."""

import json

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, parse_section
from pipeline.training import checkpoint as ckpt
from pipeline.training.loss import token_loss_sum
from pipeline.training.pretrain import PretrainConfig, run_pretrain
from pipeline.data.shards import DataError, PackedRows
from pipeline.errors import StageError
from pipeline.training.sft import SFTConfig, SFTError, prepare_sft, run_sft
from tests.helpers import synthetic_docs, train_params, write_packed, write_split
from tests.pipeline.data.test_chat import tiny_tokenizer

TRAIN = train_params(precision="fp32", micro_batch_size=4, warmup_steps=1, log_every=1, eval_every=100,
                     eval_rows=8, checkpoint_every=100, track=False, peak_flops=1e15)


def sft_data(out, vocab=64, seq_len=32):
    docs = synthetic_docs(200, vocab, seed=5)
    # loss on the second half of each "conversation" only, as SFT labels do
    labels = [np.where(np.arange(len(d)) >= len(d) // 2, d, -100).astype(np.int32) for d in docs]
    splits = {"train": write_split(out / "train", docs[20:], seq_len, labels[20:]),
              "val": write_split(out / "val", docs[:20], seq_len, labels[:20])}
    (out / "manifest.json").write_text(json.dumps({"tokenizer_sha256": "synthetic", "splits": splits}))
    return out


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pre")
    cfg = parse_section(PretrainConfig, train_params(TRAIN, model={"preset": "tiny"}, max_steps=6), "pretrain")
    run_pretrain(cfg, write_packed(tmp / "packed"), tmp / "models", tmp / "pretrain.csv")
    return tmp / "models"


def sft_cfg(**kw):
    return parse_section(SFTConfig, train_params(TRAIN, **{"seq_len": 32, "max_steps": 4, **kw}), "sft")


def test_sft_starts_from_pretrained_weights_and_trains_only_labels(tmp_path, pretrained):
    data = sft_data(tmp_path / "sft")
    m = run_sft(sft_cfg(), data, pretrained, tmp_path / "models", tmp_path / "sft.csv")
    assert m["steps"] == 4 and m["init_step"] == 6
    assert json.loads((tmp_path / "models" / "report.json").read_text())["init_from"]["step"] == 6
    # step 1's update started from the pretrained weights: redo it by hand
    from pipeline.model.transformer import ModelConfig, Transformer

    init = ckpt.latest(pretrained)
    model = Transformer(ModelConfig(**init.meta["model"]))
    ckpt.load_model_weights(init, model)
    first_loss = float(open(tmp_path / "sft.csv").read().splitlines()[1].split(",")[1])
    from pipeline.data.shards import PackedRows
    from pipeline.training.sampler import GlobalOrder

    rows = PackedRows(data / "train")
    order = GlobalOrder(len(rows), 1337, 4, 1, 1, 0)
    b = rows.batch(order.next_step()[0], torch.device("cpu"))
    loss = token_loss_sum(model(b["input_ids"], segment_ids=b["segment_ids"]), b["targets"])
    assert first_loss == pytest.approx(loss.item() / int((b["targets"] != -100).sum()), rel=1e-5)
    assert (b["targets"] == -100).any() and (b["targets"] != -100).any()


def test_refuses_an_unfinished_pretrain(tmp_path, pretrained):
    unfinished = tmp_path / "unfinished"
    c = ckpt.latest(pretrained)
    import shutil

    shutil.copytree(c.path, unfinished / c.path.name)
    meta = json.loads((unfinished / c.path.name / "meta.json").read_text())
    meta["final"] = False
    (unfinished / c.path.name / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SFTError, match="not pretrain's final checkpoint"):
        run_sft(sft_cfg(), sft_data(tmp_path / "sft"), unfinished, tmp_path / "models", tmp_path / "sft.csv")
    with pytest.raises(SFTError, match="run `dvc repro pretrain` first"):
        run_sft(sft_cfg(), sft_data(tmp_path / "sft2"), tmp_path / "nothing", tmp_path / "m2", tmp_path / "s.csv")


def test_sft_seq_len_beyond_model_is_refused(tmp_path, pretrained):
    with pytest.raises(SFTError, match="exceeds the pretrained model's max_seq_len"):
        run_sft(sft_cfg(seq_len=4096), sft_data(tmp_path / "sft"), pretrained, tmp_path / "m", tmp_path / "s.csv")


def test_the_launcher_refuses_a_seq_len_beyond_the_model_before_building_the_data(tmp_path, pretrained):
    """The model is known from the checkpoint's metadata: building the data first
    would cost its whole build time (minutes on real data) for nothing."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer().to_str())
    max_seq_len = ckpt.model_config(ckpt.latest(pretrained)).max_seq_len
    cfg = sft_cfg(data={"seq_len": max_seq_len + 1, "overlong": "truncate", "max_examples": 50})
    with pytest.raises(SFTError) as err:
        prepare_sft(cfg, tok, tmp_path / "sft", tmp_path / "q.jsonl", pretrained, tmp_path / "models")
    assert str(err.value) == (f"sft.data.seq_len {max_seq_len + 1} exceeds the pretrained model's max_seq_len "
                              f"{max_seq_len}; lower it")
    assert not (tmp_path / "sft").exists() and not (tmp_path / "models").exists()


def test_the_launcher_refuses_a_batch_the_built_train_split_cannot_fill_or_a_damaged_run(tmp_path):
    """prepare_sft builds the SFT shards, then refuses a global batch their train
    split cannot fill, or a run whose checkpoints are all damaged, before torchrun
    starts (every rank would refuse it later)."""
    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer().to_str())
    cfg = parse_section(PretrainConfig, train_params(TRAIN, model={"preset": "tiny"}, max_steps=2), "pretrain")
    vocab = tiny_tokenizer().get_vocab_size()  # the model embeds every id of the tokenizer
    run_pretrain(cfg, write_packed(tmp_path / "packed", vocab=vocab, tokenizer=tok), tmp_path / "pretrain",
                 tmp_path / "p.csv")
    data = {"data": {"seq_len": 128, "overlong": "truncate", "max_examples": 300}}

    def prepare(**kw):
        return prepare_sft(sft_cfg(**data, **kw), tok, tmp_path / "sft", tmp_path / "q.jsonl", tmp_path / "pretrain",
                           tmp_path / "models")

    prepare()
    rows = len(PackedRows(tmp_path / "sft" / "train"))
    prepare(micro_batch_size=rows)
    with pytest.raises(DataError) as err:
        prepare(micro_batch_size=rows + 1)
    assert f"one step needs {rows + 1} rows" in str(err.value) and f"train split has only {rows}" in str(err.value)
    assert not (tmp_path / "models").exists()
    # A run whose every checkpoint is damaged stops in the launcher too, naming the file, and the data
    # build's numbers (data/sft/report.json) reach the run's metrics.
    m = run_sft(sft_cfg(**data, max_steps=2), tmp_path / "sft", tmp_path / "pretrain", tmp_path / "models",
                tmp_path / "s.csv")
    assert m["examples_in"] == json.loads((tmp_path / "sft" / "report.json").read_text())["examples_in"] > 0
    [saved] = ckpt.complete_checkpoints(tmp_path / "models")
    weights = saved.path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + bytes([weights.read_bytes()[-1] ^ 0xFF]))
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors: sha256 differs"):
        prepare(max_steps=2)


def test_the_launcher_refuses_a_tokenizer_the_model_was_not_trained_with_before_building_the_data(tmp_path, pretrained):
    """Another tokenizer was refused only after the data build; one with ids past the
    embedding, from a checkpoint that records no tokenizer, stopped a rank in an IndexError."""
    import shutil

    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer().to_str())  # 450 ids; the pretrained model embeds 64
    c = ckpt.latest(pretrained)

    def copy(name, vocab_size, **meta_changes):  # the checkpoint with other meta.json values
        shutil.copytree(c.path, tmp_path / name / c.path.name)
        meta = json.loads((tmp_path / name / c.path.name / "meta.json").read_text())
        assert meta.pop("tokenizer_sha256") == "synthetic"  # a marker, not a sha256: nothing to compare
        meta["model"]["vocab_size"] = vocab_size  # the check reads the model from meta.json, before any weight
        (tmp_path / name / c.path.name / "meta.json").write_text(json.dumps({**meta, **meta_changes}))
        return tmp_path / name

    recorded = copy("recorded", 450, tokenizer_sha256="0" * 64)  # every id fits, but it is another tokenizer
    with pytest.raises(SFTError, match=rf"^\S*{c.path.name}: \S*tokenizer.json \(sha256 \w+…\) is not the tokenizer "
                                       r"this model was trained with \(sha256 000000000000…\); "
                                       r"run `dvc repro tokenizer pretrain` before sft$"):
        prepare_sft(sft_cfg(), tok, tmp_path / "sft", tmp_path / "q.jsonl", recorded, tmp_path / "models")
    unrecorded = copy("unrecorded", 449)  # one id short
    with pytest.raises(SFTError, match=rf"^\S*{c.path.name}: the tokenizer has ids up to 449 \(450 tokens\), the model "
                                       "embeds only 449; sft needs the tokenizer the model was pretrained with$"):
        prepare_sft(sft_cfg(), tok, tmp_path / "sft", tmp_path / "q.jsonl", unrecorded, tmp_path / "models")
    assert not (tmp_path / "sft").exists() and not (tmp_path / "models").exists()


def test_the_launcher_refuses_an_attention_this_machine_cannot_train_with(tmp_path, pretrained):
    if torch.cuda.is_available():
        pytest.skip("the refusal is that of a machine without CUDA")
    params = train_params(TRAIN, seq_len=32, max_steps=4)
    params["compute"] = {**params.get("compute", {}), "attention": "flex"}
    with pytest.raises(StageError, match="attention flex trains on CUDA only"):
        prepare_sft(parse_section(SFTConfig, params, "sft"), tmp_path / "tokenizer.json", tmp_path / "sft",
                    tmp_path / "q.jsonl", pretrained, tmp_path / "models")
    assert not (tmp_path / "sft").exists() and not (tmp_path / "models").exists()  # refused before building data


def test_the_launcher_refuses_fsdp_in_fp16_before_building_the_data(tmp_path, pretrained):
    with pytest.raises(StageError, match="compute.parallelism fsdp trains in bf16 or fp32, not fp16"):
        prepare_sft(sft_cfg(precision="fp16", parallelism="fsdp"), tmp_path / "tokenizer.json", tmp_path / "sft",
                    tmp_path / "q.jsonl", pretrained, tmp_path / "models")
    assert not (tmp_path / "sft").exists() and not (tmp_path / "models").exists()


def test_sft_params_validate_data_and_training_keys():
    cfg = sft_cfg(data={"overlong": "truncate", "sources": [{"path": "x.jsonl", "format": "alpaca"}]})
    assert cfg.data.overlong == "truncate" and cfg.data.sources[0].format == "alpaca" and cfg.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match=r"sft\.data\.overlong"):
        sft_cfg(data={"overlong": "cut"})
    with pytest.raises(ConfigError, match=r"sft\.data\.sources\.0\.format"):
        sft_cfg(data={"sources": [{"path": "x.jsonl", "format": "openai"}]})


def test_sft_metrics_keep_the_data_build_numbers_and_leave_the_tables_to_the_report(tmp_path):
    from pipeline.data.sft_data import SFTDataConfig, build_sft_data
    from pipeline.training.sft import data_metrics
    from tests.pipeline.data.test_chat import tiny_tokenizer
    from tests.pipeline.data.test_sft_data import messages_rec, write_jsonl

    tok = tmp_path / "tokenizer.json"
    tok.write_text(tiny_tokenizer().to_str())
    lines = [messages_rec(i) for i in range(12)] + [{"messages": "not a list"}, {"nothing": 1}, {"nothing": 2}]
    write_jsonl(tmp_path / "chat.jsonl", lines)
    cfg = SFTDataConfig(sources=[{"path": str(tmp_path / "chat.jsonl")}], seq_len=64, val_fraction=0.25)
    build = build_sft_data(cfg, tok, tmp_path / "sft", tmp_path / "q.jsonl")
    m = data_metrics(build)
    assert m["examples_in"] == 12 + 3 and m["skipped"] == 3 and m["examples"] == 12  # 3 records, 2 reasons
    assert m["label_tokens"] == build["train"]["label_tokens"] + build["val"]["label_tokens"]
    assert m["examples"] + m["skipped"] == m["examples_in"]  # every record is accounted for
    assert m["train_rows"] == build["train"]["rows"] > 0 and m["val_rows"] == build["val"]["rows"] > 0
    assert all(isinstance(v, (int, float)) for v in m.values())


def test_sft_starts_from_a_sharded_pretrain_checkpoint(tmp_path, pretrained):
    """An FSDP pretrain run's sharded checkpoint seeds sft (plain or FSDP) exactly
    as the single-file checkpoint of the same run does."""
    cfg = parse_section(PretrainConfig, train_params(TRAIN, model={"preset": "tiny"}, max_steps=6,
                                                     parallelism="fsdp"), "pretrain")
    run_pretrain(cfg, write_packed(tmp_path / "packed"), tmp_path / "pre", tmp_path / "pretrain.csv")
    assert ckpt.is_sharded(ckpt.latest(tmp_path / "pre")) and not ckpt.is_sharded(ckpt.latest(pretrained))
    data = sft_data(tmp_path / "sft")
    curves = {}
    for name, source, parallelism in [("file", pretrained, "ddp"), ("sharded", tmp_path / "pre", "ddp"),
                                      ("sharded-fsdp", tmp_path / "pre", "fsdp")]:
        run_sft(sft_cfg(parallelism=parallelism), data, source, tmp_path / name, tmp_path / f"{name}.csv")
        curves[name] = open(tmp_path / f"{name}.csv").read().splitlines()[1:]
        curves[name] = [row.split(",")[1] for row in curves[name]]
    assert curves["sharded"] == curves["file"] == curves["sharded-fsdp"]


def test_plan_checks_the_tokenizer_and_carries_the_data_identity_and_hf_config(tmp_path, monkeypatch):
    """The data must come from the pretrained model's tokenizer (a checkpoint that does not record one is
    taken on trust); the data identity covers both splits; the Hugging Face config travels on to export."""
    from types import SimpleNamespace

    from pipeline.training import sft

    data = sft_data(tmp_path / "sft")  # its manifest: tokenizer_sha256 "synthetic"
    init = SimpleNamespace(meta={}, path=tmp_path / "step_6", step=6)
    monkeypatch.setattr(sft, "starting_model", lambda cfg, pretrain_dir: (init, SimpleNamespace(vocab_size=64)))
    init.meta = {"tokenizer_sha256": "another", "hf_config": {"a": 1}}
    with pytest.raises(SFTError, match="tokenized with a different tokenizer"):
        sft.plan(sft_cfg(), data, tmp_path)
    init.meta = {"hf_config": {"a": 1}, "hf_generation_config": {"b": 2}}  # no tokenizer recorded
    _, _, data_id, meta = sft.plan(sft_cfg(), data, tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    assert data_id.split(",") == [s["sha256"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]]
    assert meta == {"tokenizer_sha256": "synthetic", "init_from": str(init.path), "vocab_size": 64,
                    "hf_config": {"a": 1}, "hf_generation_config": {"b": 2}}
