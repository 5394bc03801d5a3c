"""sft: models/pretrain + sft.data.sources -> data/sft shards, models/sft (+ plots/sft.csv, metrics/sft.json).

The launcher checks that pretrain finished and builds the SFT shards once under
the trainer lock, then relaunches this module under torchrun, exactly as
pretrain does.
"""

from pipeline import layout
from pipeline.runner import run_training_stage
from pipeline.training.sft import SFTConfig, prepare_sft, run_sft


def prepare(cfg: SFTConfig) -> dict:
    return prepare_sft(cfg, layout.TOKENIZER_JSON, layout.SFT_DATA, layout.SFT_QUARANTINE, layout.PRETRAIN_MODEL,
                       layout.SFT_MODEL)


def main(cfg: SFTConfig) -> dict:
    return run_sft(cfg, layout.SFT_DATA, layout.PRETRAIN_MODEL, layout.SFT_MODEL, layout.plots_path("sft"))


if __name__ == "__main__":
    run_training_stage("sft", "stages.sft", layout.SFT_MODEL, main, prepare=prepare)
