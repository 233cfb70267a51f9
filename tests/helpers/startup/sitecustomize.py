"""Counts interpreter starts for the suite's report (tests/conftest.py puts this folder on PYTHONPATH): every Python
process the tests start, directly or through a launcher, appends the test that was running to one file. A process
forked from another (a forkserver's child) is no start and is not counted."""

import os

_path = os.environ.get("FSDP_RESEARCH_TEST_STARTS")
if _path:
    with open(_path, "a") as _f:
        _f.write(os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0] + "\n")
