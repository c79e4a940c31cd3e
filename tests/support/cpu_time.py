"""A pytest plugin that records each test's CPU seconds, the measure behind ``tests/slow.txt``.

Why CPU and not wall time: the suite is often run on a machine shared with other work, where a
test's wall time says more about the neighbours than about the test. CPU seconds of this
process and of the child processes it waited for (``subprocess.run``, a pool it joined) do not
grow with the load. Rank processes forked by ``support.multiproc``'s server are not the test's
children but the server's, which reaps them: the CPU of this process's live children and of the
children they reaped (the server's, so its ranks') is counted too, read from ``/proc`` (Linux;
elsewhere those tests count only their own process).

Use (``docs/testing.md``, "Markers and tiers")::

    SPMD_AOT_CPU_TIMES=times.jsonl python -m pytest -p support.cpu_time -m "not multiproc and not corpus"

One JSON line per test: its node id, wall seconds and CPU seconds (setup, call and teardown: a
module's shared fixture is charged to the first test that uses it).
"""

from __future__ import annotations

import json
import os
import resource
import time

import pytest

ENV = "SPMD_AOT_CPU_TIMES"


def _live_children_seconds() -> float:
    """CPU of this process's running children and of what they reaped (utime, stime, cutime, cstime)."""
    me, total = os.getpid(), 0.0
    try:
        with open(f"/proc/{me}/task/{me}/children", encoding="ascii") as f:
            pids = f.read().split()
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except OSError:  # ended meanwhile: its parent's reaping counts it
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + _live_children_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(ENV)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    yield
    if path:
        row = {"id": item.nodeid, "wall": round(time.perf_counter() - wall, 3), "cpu": round(_cpu_seconds() - cpu, 3)}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
