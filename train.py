"""Hydra entry point: `python train.py <group>=<option> <key>=<value> ...` (see README.md)."""

import os
import sys

# GNU OpenMP's idle workers spin 3,000 rounds before they sleep, not 300,000: as fast on an idle machine, and a rank
# whose cores another job shares no longer spins them away (2.65x the idle step instead of 4.4x beside a 2-thread
# job; bench/threads.py). Read once, as torch loads OpenMP: set before the first import of torch. Yours wins.
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fsdp_research.distributed import forkserver
from fsdp_research.distributed.processes import device_for, launch_env, starts_own_workers
from fsdp_research.errors import ConfigError
from fsdp_research.jobs.compose import check_command_line, continue_run, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    env = launch_env()
    if env is None or env.rank == 0:
        print(f"run dir: {HydraConfig.get().runtime.output_dir}", flush=True)
    try:
        cfg = continue_run(cfg)
    except ConfigError as err:
        _refuse(err)
    if starts_own_workers(cfg.distributed) and _on_cpu(cfg.trainer.device):
        forkserver.start()  # the workers' imports on another core, beside this process's own below
    # Here, not at the top: a bad command line is refused before transformers is imported.
    from fsdp_research.jobs.launch import launch

    return launch(cfg, HydraConfig.get().runtime.output_dir)


def _on_cpu(device: str) -> bool:
    """Whether the workers will be forked (CUDA's are spawned); another value is launch's to refuse."""
    return device == "cpu" or device == "auto" and device_for(device, 0).type == "cpu"


def _refuse(err: ConfigError) -> None:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)


def _command_line() -> None:
    try:
        check_command_line(sys.argv[1:])
    except ConfigError as err:
        _refuse(err)
    main()


if __name__ == "__main__":
    env = launch_env()
    if env is not None and env.rank != 0:
        # Under torchrun/srun every rank runs this file: only rank 0 makes the run dir (its timestamp is
        # its own); the others are told rank 0's run dir once the process group exists.
        sys.argv += ["hydra.run.dir=."]
    forkserver.run_and_exit(_command_line)
