"""stages/export.py: the model card and the registry carry the metrics of the
checkpoint shipped, never those of another checkpoint of the run."""

import pytest

from pipeline import layout
from pipeline.config import parse_section
from pipeline.evaluate import EvaluateConfig, evaluate_models
from pipeline.export import ExportConfig, ExportError
from pipeline.files import read_json, sha256_file, write_json
from pipeline.training import checkpoint as ckpt
from stages import export
from tests.helpers import save_checkpoint, synthetic_docs, tiny_config, tiny_model, train_tiny_tokenizer, write_split

pytestmark = pytest.mark.usefixtures("one_thread")


def test_export_of_the_best_checkpoint_needs_evaluate_to_score_it(tmp_path, monkeypatch):
    """sft kept its best checkpoint (step 2) besides its last (step 4); export.checkpoint: best.
    evaluate scoring the last one is refused in one line saying what to set; scoring the best one,
    the card's metrics are those of the weights shipped."""
    monkeypatch.chdir(tmp_path)
    tok = train_tiny_tokenizer(layout.TOKENIZER_JSON)
    vocab = tok.get_vocab_size()
    write_split(layout.PACKED / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    for step in (2, 4):
        save_checkpoint(layout.SFT_MODEL, tiny_model(tiny_config(vocab), seed=step), step=step,
                        meta={"tokenizer_sha256": sha256_file(layout.TOKENIZER_JSON)})
    write_json(layout.SFT_MODEL / ckpt.BEST, {"step": 2, "path": "step-00000002", "val_loss": 1.0,
                                              "fingerprint": "f" * 16})
    cfg = parse_section(ExportConfig, {"checkpoint": "best", "register_model": False}, "export")

    def evaluate(which: str) -> dict:
        ecfg = parse_section(EvaluateConfig, {"checkpoint": {"sft": which}}, "evaluate")
        metrics, _ = evaluate_models(ecfg, {"sft": layout.SFT_MODEL}, {"text": layout.PACKED / "val"},
                                     layout.TOKENIZER_JSON, layout.EVALUATE_REPORT, which=ecfg.checkpoint.model_dump())
        write_json(layout.metrics_path("evaluate"), metrics)
        return metrics

    last = evaluate("last")
    with pytest.raises(ExportError, match=r"^export.checkpoint: best ships \S*step-00000002 \(step 2\), but the "
                                          r"evaluate metrics describe \S*step-00000004 \(step 4\), .*; set "
                                          r"evaluate.checkpoint.sft: best \(or export.checkpoint: last\) and run "
                                          r"`dvc repro`$"):
        export.main(cfg, None)
    assert not layout.EXPORT_DIR.exists()

    best = evaluate("best")
    assert best["sft"]["val_loss"] != last["sft"]["val_loss"]
    assert read_json(layout.EVALUATE_REPORT)["sft"]["checkpoint_step"] == 2
    assert export.main(cfg, None)["step"] == 2
    card = (layout.EXPORT_DIR / "README.md").read_text()
    assert f"| sft.val_loss | {best['sft']['val_loss']:.6g} |" in card
    assert f"{last['sft']['val_loss']:.6g}" not in card

    layout.EVALUATE_REPORT.unlink()  # metrics with no record of what they describe are not used
    with pytest.raises(ExportError, match=r"report.json not found; run `dvc repro evaluate` first"):
        export.main(cfg, None)


def test_a_primary_metric_that_evaluate_did_not_write_is_refused_before_the_export(tmp_path, monkeypatch):
    """A typo in export.primary_metric registered every export as candidate and
    none as champion, silently: it is refused in one line before any work."""
    monkeypatch.chdir(tmp_path)
    write_json(layout.metrics_path("evaluate"), {"sft": {"chat": {"bits_per_byte": 1.2}, "val_loss": 2.0}})
    write_json(layout.EVALUATE_REPORT, {})
    cfg = parse_section(ExportConfig, {"primary_metric": "sft.chat.bpb"}, "export")
    with pytest.raises(ExportError, match=r"^export.primary_metric: 'sft.chat.bpb' is not a metric of the evaluation, "
                                          r".*it has 2: sft.chat.bits_per_byte, sft.val_loss \(in metrics/evaluate.json\)$"):
        export.main(cfg, None)
    assert not layout.EXPORT_DIR.exists()
    # A name that is there passes the check (the next one wants evaluate's report),
    # and so does any name when nothing is registered.
    for ok in ({"primary_metric": "sft.val_loss"}, {"primary_metric": "sft.chat.bpb", "register_model": False}):
        with pytest.raises(ExportError, match="records no sft model"):
            export.main(parse_section(ExportConfig, ok, "export"), None)


@pytest.mark.parametrize("damage", ["cut-short", "list"])
@pytest.mark.parametrize("name", ["metrics", "report"])
def test_evaluate_s_outputs_damaged_are_one_line_before_the_export(tmp_path, monkeypatch, name, damage):
    """A cut-short or foreign metrics/evaluate.json or data/evaluate/report.json ended export in a
    JSONDecodeError or AttributeError traceback."""
    from pipeline.files import DamagedFileError

    monkeypatch.chdir(tmp_path)
    write_json(layout.metrics_path("evaluate"), {"sft": {"chat": {"bits_per_byte": 1.2}}})
    write_json(layout.EVALUATE_REPORT, {})
    path = layout.metrics_path("evaluate") if name == "metrics" else layout.EVALUATE_REPORT
    path.write_text('{"sft": ' if damage == "cut-short" else "[]")
    error, message = ((DamagedFileError, rf"^{path} is damaged: not valid JSON") if damage == "cut-short" else
                      (ExportError, rf"^{path} is not evaluate's \(not a JSON object\); run `dvc repro evaluate`$"))
    with pytest.raises(error, match=message):
        export.main(parse_section(ExportConfig, {"register_model": False}, "export"), None)
    assert not layout.EXPORT_DIR.exists()


def test_export_source_pretrain_ships_pretrain_s_checkpoint_without_sft_s_chat_template(tmp_path, monkeypatch):
    """export.source: pretrain ships models/pretrain's checkpoint, labelled with its own scores, and
    the chat set-up of a model that never trained on chat (ChatML), not the template SFT rendered with."""
    from pipeline.data.chat import CHAT_TEMPLATE_JINJA

    monkeypatch.chdir(tmp_path)
    tok = train_tiny_tokenizer(layout.TOKENIZER_JSON)
    vocab, sha = tok.get_vocab_size(), sha256_file(layout.TOKENIZER_JSON)
    write_split(layout.PACKED / "val", synthetic_docs(20, vocab, seed=3), seq_len=16)
    for folder, step, stage in ((layout.PRETRAIN_MODEL, 3, "pretrain"), (layout.SFT_MODEL, 7, "sft")):
        save_checkpoint(folder, tiny_model(tiny_config(vocab), seed=step), step=step,
                        meta={"tokenizer_sha256": sha, "stage": stage})
    write_json(layout.SFT_DATA / "manifest.json", {"chat_template": "{{ messages }}", "stop_ids": [3, 0]})
    ecfg = parse_section(EvaluateConfig, {}, "evaluate")
    metrics, _ = evaluate_models(ecfg, {"pretrain": layout.PRETRAIN_MODEL, "sft": layout.SFT_MODEL},
                                 {"text": layout.PACKED / "val"}, layout.TOKENIZER_JSON, layout.EVALUATE_REPORT)
    write_json(layout.metrics_path("evaluate"), metrics)
    cfg = parse_section(ExportConfig, {"source": "pretrain", "register_model": False, "license": "mit",
                                       "name": "tiny-pretrained", "dtype": "bfloat16"}, "export")
    assert export.main(cfg, None)["step"] == 3
    card = (layout.EXPORT_DIR / "README.md").read_text()
    assert "\nlicense: mit\n" in card and "\n# tiny-pretrained\n" in card
    config, report = (read_json(layout.EXPORT_DIR / name) for name in ("config.json", "report.json"))
    assert config["dtype"] == report["dtype"] == "bfloat16"
    assert read_json(layout.EXPORT_DIR / "tokenizer_config.json")["chat_template"] == CHAT_TEMPLATE_JINJA
    assert read_json(layout.EXPORT_DIR / "report.json")["checkpoint"].endswith("pretrain/step-00000003")
