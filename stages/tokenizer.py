"""tokenizer: data/clean/docs.parquet -> data/tokenizer/tokenizer.json (+ metrics/tokenizer.json)."""

from pipeline import layout
from pipeline.runner import run_stage
from pipeline.data.tokenizer import TokenizerConfig, train_tokenizer


def main(cfg: TokenizerConfig) -> dict:
    return train_tokenizer(cfg, layout.CLEAN_DOCS, layout.TOKENIZER_JSON)


if __name__ == "__main__":
    run_stage("tokenizer", main)
