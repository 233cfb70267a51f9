"""Checkpoints: resume checkpoints written by every rank with DCP and pruned (dcp), found, verified and loaded
(resume), the Hugging Face directory written once at the end or offline (hf_export), and the consolidation of
safetensors parts into one index (consolidate)."""
