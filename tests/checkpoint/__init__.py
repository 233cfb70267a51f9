"""Resume checkpoints, export, resume."""
