"""Parameter names as the model defines them, whatever wraps its modules: the optimizer's groups, the checkpoints
and the exported weights all name a parameter this way."""

# The path components FSDP, activation checkpointing and torch.compile insert; a real name's `module` is kept.
_WRAPPERS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}


def clean_name(name: str) -> str:
    """Parameter name without the wrappers' path components (activation checkpointing, FSDP, torch.compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)
