"""Configs are composed with Hydra's compose API (fsdp_research.jobs.compose.compose), exactly as train.py composes
them; outputs go to tmp dirs."""

import collections
import glob
import os
import re
import sysconfig

import pytest

from tests.helpers import beside

# As train.py does for a run, before anything loads torch (and its OpenMP): the suite runs a 1-rank pool beside a
# 2-rank one (the census) and SLURM's jobs beside the rest, and GNU OpenMP's idle workers spinning their default
# 300,000 rounds spend a shared core's time (tests/census, 30 families: 54 -> 49 s, mean of 4 runs each).
os.environ.setdefault("GOMP_SPINCOUNT", "3000")

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


# Where the suite's time goes (printed at its end, docs/benchmarks/tests.md): seconds and interpreter starts per
# test module. Every process the tests start imports tests/helpers/startup/sitecustomize.py, which counts it.
_STARTS = os.path.join(ROOT, ".pytest_cache", f"starts-{os.getpid()}.txt")
_seconds: collections.Counter = collections.Counter()


def pytest_configure(config):
    os.makedirs(os.path.dirname(_STARTS), exist_ok=True)
    open(_STARTS, "w").close()
    os.environ["FSDP_RESEARCH_TEST_STARTS"] = _STARTS
    startup = os.path.join(ROOT, "tests", "helpers", "startup")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [startup, os.environ.get("PYTHONPATH")]))


def pytest_runtest_logreport(report):
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter):
    with open(_STARTS) as f:
        starts = collections.Counter(line.strip() for line in f)
    modules = sorted(set(_seconds) | set(starts) - {"?"}, key=lambda m: -_seconds[m])
    if not modules:
        return
    terminalreporter.section("time per test module")
    terminalreporter.write_line(_machine())
    terminalreporter.write_line(f"{'seconds':>8} {'starts':>6}  module")
    for module in modules:
        terminalreporter.write_line(f"{_seconds[module]:8.1f} {starts[module]:6d}  {module}")
    terminalreporter.write_line(f"{sum(_seconds.values()):8.1f} {sum(starts.values()):6d}  total")
    if _beside:
        title = f"{beside.FOLDER}: {_beside.count} test(s) run beside the rest (deselected above), exit code"
        terminalreporter.section(f"{title} {_beside.returncode}")
        terminalreporter.write(_beside.report())


def _machine() -> str:
    """The kind of machine the times are of: bf16 matmuls run ~35x slower without AVX-512 BF16, and the
    35-minute aim of CI is for such machines (issue 43)."""
    cores = f"{len(os.sched_getaffinity(0))} cores"
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return f"machine: {cores}"
    model = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
    bf16 = "with" if re.search(r"\bavx512_bf16\b", info) else "without"
    return f"machine: {model.group(1) if model else 'unknown CPU'}, {cores}, {bf16} AVX-512 BF16"


_beside: beside.Beside | None = None


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """The markers whole folders carry (before -m and -k choose): tests/slurm (a real cluster, many launches) and
    tests/census (every family) are slow and distributed (the census on pools of 1 and 2 ranks); tests/slurm is
    slurm too. Then, of what was chosen, the SLURM tests go to a pytest of their own beside this one, which runs the
    modules that leave a core idle first."""
    for item in items:
        parts = item.nodeid.split("/")
        if parts[1:2] == ["slurm"]:
            item.add_marker(pytest.mark.slurm)
        if parts[1:2] in (["slurm"], ["census"]):
            item.add_marker(pytest.mark.slow)
            item.add_marker(pytest.mark.distributed)
    yield
    global _beside
    _beside = beside.split(items, config)


def pytest_sessionfinish(session, exitstatus):
    if _beside and _beside.finish(failed=exitstatus != 0) not in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
