"""A researcher's own project on fsdp_research: a model, an optimizer, a schedule, a loss, an objective and a
callback of its own, and configs for them, outside the framework's repository (see ../README.md)."""
