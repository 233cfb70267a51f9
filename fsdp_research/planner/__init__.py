"""Memory and communication planner: per-rank memory and per-step traffic and time of a config, without
allocating the model. summary (what it knows of a config), memory, traffic, timing, fit (`plan --fit` and the
doctor's fit check), format (its output), doctor (the causes of slow FSDP); `fsdp-research plan` is its command."""
