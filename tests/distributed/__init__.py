"""Sharding plans, precision, the FSDP2 knobs, threads per rank."""
