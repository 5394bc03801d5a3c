"""The model family: the decoder-only transformer, its Hugging Face adapter, and generation."""
