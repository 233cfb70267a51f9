"""Tools above training: simulate (one rank of an N-rank job on the fake process group) and scaling (samples/s
at 1..N devices, the abandon verdict)."""
