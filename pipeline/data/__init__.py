"""Data stages and on-disk data formats: ingest → clean → tokenizer → pack, the packed-row shard format, and the SFT chat data."""
