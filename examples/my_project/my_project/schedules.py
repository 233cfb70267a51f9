"""A learning rate multiplier of (step, max_steps): steps down by `gamma` every `every` steps after a warmup."""


def step_decay(step: int, max_steps: int, warmup: int = 5, every: int = 10, gamma: float = 0.5) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return gamma ** ((step - warmup) // every)
