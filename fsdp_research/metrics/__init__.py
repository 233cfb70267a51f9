"""What a run measures and where it goes: FLOPs per token, MFU, throughput and peak memory (meters), the sinks
(console, metrics.jsonl, W&B), torch.profiler steps and their breakdown (profiling), and the hardware table (peak
FLOPs, links) the meters and the planner read."""
