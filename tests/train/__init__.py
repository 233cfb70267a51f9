"""The trainer: correctness against references, faults, eval, debugging, baselines, losses."""
