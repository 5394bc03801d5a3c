"""tokenizer: data/clean/docs.parquet -> data/tokenizer/tokenizer.json (+ report; metrics/tokenizer.json)."""

from pipeline import layout
from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer
from pipeline.runner import run_stage

REPORT = layout.TOKENIZER_DIR / "report.json"


def main(cfg: TokenizerConfig) -> dict:
    return train_tokenizer(cfg, layout.CLEAN_DOCS, layout.TOKENIZER_JSON, REPORT)


if __name__ == "__main__":
    run_stage("tokenizer", main, artifacts=(REPORT,))
