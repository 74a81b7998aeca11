"""A pytest plugin that writes each test's CPU seconds, its own process's and its waited-for
children's (subprocesses, torchrun workers, pytester sessions, tests/forkserver.py's
grandchildren and its start), to FUSIONGUARD_TEST_CPU (a JSON lines file; one per xdist
worker, suffixed with the worker's name). CPU seconds barely change
with the machine's load, unlike wall time: the share of each test in the suite's work.

    FUSIONGUARD_TEST_CPU=/tmp/cpu.jsonl PYTHONPATH=.:benchmarks python -m pytest -q -p pytest_cpu
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import pytest


def _cpu() -> tuple:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    forked = getattr(sys.modules.get("forkserver"), "CHILD_CPU", 0.0)  # (tests/forkserver.py's grandchildren are not our children)
    return s.ru_utime + s.ru_stime, c.ru_utime + c.ru_stime + forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("FUSIONGUARD_TEST_CPU")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    (s0, c0), t0 = _cpu(), time.perf_counter()
    yield
    (s1, c1), t1 = _cpu(), time.perf_counter()
    if path:
        with open(f"{path}.{worker}" if worker else path, "a") as fh:
            fh.write(
                json.dumps(
                    {
                        "test": item.nodeid,
                        "self": round(s1 - s0, 2),
                        "children": round(c1 - c0, 2),
                        "wall": round(t1 - t0, 2),
                        "worker": worker,
                    }
                )
                + "\n"
            )
