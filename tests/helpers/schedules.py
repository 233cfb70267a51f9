"""The lr schedules written out, from their papers' formulas, to check ours against."""

import math


def expected_multiplier(
    name: str, step: int, total: int, warmup=10, floor=0.1, decay_ratio=0.2, shape="linear"
) -> float:
    """The schedules written out."""
    if step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    if name == "inverse_sqrt":
        return (warmup / (step + 1)) ** 0.5
    if name == "wsd":
        start = total - round(decay_ratio * total)
        if step < start:
            return 1.0
        p = (step - start) / (total - start)
        down = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "sqrt": 1 - p**0.5}[shape]
        return floor + (1 - floor) * down
    p = (step - warmup) / (total - warmup)
    return floor + (1 - floor) * ((1 + math.cos(math.pi * p)) / 2 if name == "cosine" else 1 - p)
