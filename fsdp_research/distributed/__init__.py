"""Everything about ranks: process groups, the launch environment and spawned workers (processes), how a step is
laid out over the ranks (step_layout), the device mesh and every rank and size on it (mesh), the sharding plan as
data and its application with fully_shard or torch's DDP (sharding), mixed precision (precision), activation
checkpointing, compile, and parameter names as the model defines them whatever wraps it (names)."""
