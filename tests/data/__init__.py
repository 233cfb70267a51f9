"""Data: formats, token stores, sampling, the tokenizer."""
