"""Metrics: MFU, FLOPs, memory, profiling."""
