"""torch.compile of the repeating blocks (trainer.compile), applied before sharding."""

import torch
import torch.nn as nn


def apply_compile(blocks: list[nn.Module], enabled: bool) -> None:
    """Compile each block's forward, not the module: module.compile() compiles its __call__, which would take the
    hooks FSDP registers on the block into the compiled region and break it into pieces around them. Compiling
    forward keeps FSDP's all-gathers and reduce-scatters outside, as torchtitan does. fullgraph: a block is one
    graph (llama's and Mixtral's are, tried), and one that breaks says so at its first step instead of running
    slowly in pieces."""
    if enabled:
        for block in blocks:
            block.forward = torch.compile(block.forward, fullgraph=True)
