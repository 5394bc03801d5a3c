"""tokenizer: data/clean/docs (+ tokenizer.source) -> data/tokenizer/ (tokenizer.json, specials.json,
hf/ when adopted, report; metrics/tokenizer.json)."""

from pipeline import layout
from pipeline.data.tokenizer import TokenizerConfig, build
from pipeline.runner import run_stage

REPORT = layout.TOKENIZER_DIR / "report.json"


def main(cfg: TokenizerConfig) -> dict:
    return build(cfg, layout.CLEAN_DOCS, layout.TOKENIZER_JSON, REPORT)


if __name__ == "__main__":
    run_stage("tokenizer", main, artifacts=(REPORT,))
