"""Data: sources (readers per file format) -> tokenizer -> token store (built once, read by position) -> sampling
(windows by global sample index) -> pipeline (config to batches, read ahead); chat (conversations and their
targets) and packing (documents packed into samples that keep them apart). Light to import: tokenization
workers start from fsdp_research.data.worker without torch."""
