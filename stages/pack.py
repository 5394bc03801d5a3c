"""pack: clean docs + tokenizer -> data/packed/{train,val}/shard-*.arrow + manifest, the report
(+ metrics/pack.json)."""

from pipeline import layout
from pipeline.data.pack import PackConfig, run_pack
from pipeline.runner import run_stage


def main(cfg: PackConfig) -> dict:
    return run_pack(cfg, layout.CLEAN_DOCS, layout.TOKENIZER_JSON, layout.PACKED)


if __name__ == "__main__":
    run_stage("pack", main, artifacts=(layout.PACKED_MANIFEST,))
