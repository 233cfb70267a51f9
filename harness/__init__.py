"""What the tests and the benchmarks both drive, outside the library: real jobs started as a user starts them, their
workers found, signals and SIGKILL sent, a node of the local SLURM cluster lost. bench/ imports this, never tests/."""
