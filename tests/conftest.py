"""Configs are composed with Hydra's compose API (fsdp_research.jobs.compose.compose), exactly as train.py composes
them; outputs go to tmp dirs."""

import glob
import os
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A few standard-library modules: real text, on every machine, small enough to tokenize in a second.
TEXT = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "[a-c]*.py")))

# Small, fast and exact: fp32, no W&B, every step logged.
FAST = [
    "precision=fp32",
    "logger=none",
    "trainer.log_interval=1",
    "trainer.eval_interval=0",
    "data.seq_len=64",
    f"data.paths=[{','.join(TEXT)}]",
    "checkpoint.export=false",
]


@pytest.fixture(autouse=True, scope="session")
def _offline(tmp_path_factory):
    # No hub access at run time; W&B never leaves this machine. Session-wide, so that module-scoped fixtures
    # (and the processes they start) run under it too.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.getbasetemp() / "hf_datasets"))
        # Token stores of this session's own, not the user's.
        patch.setenv("FSDP_RESEARCH_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


def pytest_collection_modifyitems(items):
    """The markers whole folders carry: tests/slurm (a real cluster, many launches) and tests/census (every family)
    are slow; tests/slurm is distributed and slurm too."""
    for item in items:
        parts = item.nodeid.split("/")
        if parts[1:2] == ["slurm"]:
            item.add_marker(pytest.mark.slurm)
            item.add_marker(pytest.mark.distributed)
        if parts[1:2] in (["slurm"], ["census"]):
            item.add_marker(pytest.mark.slow)
