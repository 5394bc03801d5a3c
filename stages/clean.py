"""clean: data/ingest/docs -> data/clean/docs (+ quarantine, report; metrics/clean.json)."""

from pipeline import layout
from pipeline.data.clean import CleanConfig, run_clean
from pipeline.runner import run_stage

REPORT = layout.CLEAN_DIR / "report.json"


def main(cfg: CleanConfig) -> dict:
    return run_clean(cfg, layout.INGEST_DOCS, layout.CLEAN_DOCS, layout.CLEAN_QUARANTINE, REPORT)


if __name__ == "__main__":
    run_stage("clean", main, artifacts=(REPORT,))
