"""ingest: raw sources -> data/ingest/docs/ (documents folder: shards + manifest, resumed after a kill)
(+ quarantine, report; metrics/ingest.json)."""

from pipeline import layout
from pipeline.data.ingest import IngestConfig, run_ingest
from pipeline.runner import run_stage

REPORT = layout.INGEST_DIR / "report.json"


def main(cfg: IngestConfig) -> dict:
    return run_ingest(cfg, layout.INGEST_DOCS, layout.INGEST_QUARANTINE, REPORT)


if __name__ == "__main__":
    run_stage("ingest", main, artifacts=(REPORT,))
