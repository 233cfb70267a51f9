"""Memory and communication planner: per-rank memory and per-step traffic of a config, without allocating the
model. summary (what it knows of a config), memory (the model of memory and traffic), format (its output);
`fsdp-research plan` is its command."""
