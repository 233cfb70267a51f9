"""Checkpoints: resume checkpoints written by every rank with DCP (dcp), the Hugging Face directory written once
at the end or offline (hf_export), and the consolidation of safetensors parts into one index (consolidate)."""
