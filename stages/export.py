"""export: models/sft -> models/export, a Hugging Face folder with a model card
(labelled with metrics/evaluate.json, refused unless evaluate scored the checkpoint shipped),
registered in MLflow as a new version (alias ``candidate``; ``champion`` moves
only when the evaluate metrics beat the current champion's), and its report.json."""

from pathlib import Path

from pipeline import layout
from pipeline.export import REPORT, ExportConfig, ExportError, export_model, write_report
from pipeline.files import read_stage_json
from pipeline.promote import check_primary_metric, register_export
from pipeline.runner import run_stage
from pipeline.tracking.tracker import dvc_stage_hashes, git_tags


def evaluate_output(path: Path) -> dict:
    """A JSON object evaluate wrote; a one-line ExportError when it is missing or is not one."""
    if not path.is_file():
        raise ExportError(f"{path} not found; run `dvc repro evaluate` first")
    value = read_stage_json(path)
    if not isinstance(value, dict):
        raise ExportError(f"{path} is not evaluate's (not a JSON object); run `dvc repro evaluate`")
    return value


def main(cfg: ExportConfig, tracker) -> dict:
    evaluation, report = (evaluate_output(path) for path in (layout.metrics_path("evaluate"), layout.EVALUATE_REPORT))
    if cfg.register_model:
        try:
            check_primary_metric(evaluation, cfg.primary_metric)
        except ValueError as err:
            raise ExportError(f"export.primary_metric: {err} (in {layout.metrics_path('evaluate')})") from None
    evaluated = report.get(cfg.source)
    if not evaluated:
        raise ExportError(f"{layout.EVALUATE_REPORT} records no {cfg.source} model; run `dvc repro evaluate` first")
    source = layout.SFT_MODEL if cfg.source == "sft" else layout.PRETRAIN_MODEL
    lineage = {**git_tags(), **{f"dvc.{k}": v for k, v in dvc_stage_hashes().items()}}
    card = {"metrics": evaluation, "lineage": lineage, "name": cfg.name, "license": cfg.license,
            "intended_use": cfg.intended_use, "limitations": cfg.limitations}
    summary = export_model(source, layout.TOKENIZER_JSON, layout.EXPORT_DIR,
                           card_info={k: v for k, v in card.items() if v is not None}, which=cfg.checkpoint,
                           evaluated=evaluated, dtype=cfg.dtype,
                           sft_manifest=layout.SFT_DATA / "manifest.json" if cfg.source == "sft" else None)
    registry = {"registered": False, "reason": "export.register_model is false"}
    if cfg.register_model:
        registry = register_export(layout.EXPORT_DIR, model_name=cfg.model_name, metrics=evaluation,
                                   run_id=tracker.run_id, primary_metric=cfg.primary_metric,
                                   lower_is_better=cfg.lower_is_better, tags=lineage)
    return write_report(layout.EXPORT_DIR, summary, registry)


if __name__ == "__main__":
    run_stage("export", main, pass_tracker=True, artifacts=(layout.EXPORT_DIR / REPORT,))
