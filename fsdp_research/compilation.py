"""torch.compile of the repeating blocks (trainer.compile), applied before sharding."""

import torch.nn as nn


def apply_compile(blocks: list[nn.Module], enabled: bool) -> None:
    """torch.compile each block before sharding (as torchtitan does), so FSDP's hooks stay outside."""
    if enabled:
        for block in blocks:
            block.compile()
