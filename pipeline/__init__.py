"""LLM training pipeline library: ingest → clean → tokenizer → pack → pretrain → sft → evaluate → export.

Every stage's logic lives here; ``stages/<name>.py`` is thin glue that reads
``params.yaml`` and calls into this package.
"""

__version__ = "0.1.0"
