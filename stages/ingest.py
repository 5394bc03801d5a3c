"""ingest: raw sources -> data/ingest/docs.parquet (+ quarantine, metrics/ingest.json)."""

from pipeline import layout
from pipeline.runner import run_stage
from pipeline.data.ingest import IngestConfig, run_ingest


def main(cfg: IngestConfig) -> dict:
    return run_ingest(cfg, layout.INGEST_DOCS, layout.INGEST_QUARANTINE)


if __name__ == "__main__":
    run_stage("ingest", main)
