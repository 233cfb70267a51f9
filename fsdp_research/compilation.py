"""torch.compile of the repeating blocks (trainer.compile), applied before sharding."""
from typing import List

import torch.nn as nn


def apply_compile(blocks: List[nn.Module], enabled: bool) -> None:
    """torch.compile each block before sharding (as torchtitan does), so FSDP's hooks stay outside."""
    if enabled:
        for block in blocks:
            block.compile()
