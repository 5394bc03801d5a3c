"""evaluate: models/{pretrain,sft} on data/packed/val and data/sft/val
-> metrics/evaluate.json (+ data/evaluate/samples.json and report.json, logged to MLflow)."""

from pipeline import layout
from pipeline.data.shards import val_sources
from pipeline.evaluate import EvaluateConfig, evaluate_models, record_samples
from pipeline.files import write_json
from pipeline.runner import run_stage

SAMPLES = layout.EVALUATE_DIR / "samples.json"
REPORT = layout.EVALUATE_REPORT


def main(cfg: EvaluateConfig) -> dict:
    models = {"pretrain": layout.PRETRAIN_MODEL, "sft": layout.SFT_MODEL}
    splits = {"text": layout.PACKED / "val", "chat": layout.SFT_DATA / "val"}
    metrics, loaded = evaluate_models(cfg, models, splits, layout.TOKENIZER_JSON, REPORT,
                                      sources=val_sources(layout.PACKED), which=cfg.checkpoint.model_dump())
    write_json(SAMPLES, record_samples(cfg.samples, loaded, layout.TOKENIZER_JSON,
                                         layout.SFT_DATA / "manifest.json"))
    return metrics


if __name__ == "__main__":
    run_stage("evaluate", main, artifacts=(SAMPLES, REPORT))
