"""pretrain: data/packed -> models/pretrain (+ plots/pretrain.csv, metrics/pretrain.json).

DVC runs ``python -m stages.pretrain``; that process checks the inputs, takes
the trainer lock and relaunches this module under torchrun with the launch
settings in params.
"""

from pipeline import layout
from pipeline.runner import run_training_stage
from pipeline.training.pretrain import PretrainConfig, prepare_pretrain, run_pretrain

OUT = layout.PRETRAIN_MODEL


def prepare(cfg: PretrainConfig) -> None:
    prepare_pretrain(cfg, layout.PACKED, OUT)


def main(cfg: PretrainConfig) -> dict:
    return run_pretrain(cfg, layout.PACKED, OUT, layout.plots_path("pretrain"))


if __name__ == "__main__":
    run_training_stage("pretrain", "stages.pretrain", OUT, main, prepare=prepare)
