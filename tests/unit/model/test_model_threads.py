"""model/threads.py: the model loaded in a passing thread, the main thread on one, so that only
the thread running the forward keeps an OpenMP team (libgomp sleeps its workers between ops
once it manages more threads than there are CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from scd_serve.model.threads import in_passing_thread

# In a python of its own with two OpenMP threads: the tasks of the process after each step (a
# team's worker is a task until its thread exits).
SCRIPT = textwrap.dedent("""
    import os, threading, time, torch
    from scd_serve.model.threads import in_passing_thread, one_thread

    def tasks(settled=None):
        for _ in range(300):  # a thread that exits leaves the process a moment later
            n = len(os.listdir("/proc/self/task"))
            if settled is None or n == settled:
                break
            time.sleep(0.01)
        return n

    x = torch.randn(1 << 22)
    start = tasks()
    assert one_thread() and torch.get_num_threads() == 1
    x.exp()  # a parallel op on this thread now runs inline: no team
    print("main", tasks() - start)
    in_passing_thread(lambda: (x.exp(), torch.get_num_threads())[1])
    print("passing", tasks(settled=start) - start)  # the team went with its thread
    out = {}
    def engine():
        x.exp()
        out["n"] = torch.get_num_threads()
        out["tasks"] = tasks() - start
    t = threading.Thread(target=engine)
    t.start()
    t.join()
    print("engine", out["n"], out["tasks"])  # another thread keeps every thread, and its team
""")


def test_only_the_forwards_thread_keeps_a_team():
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs /proc")
    env = os.environ | {"OMP_NUM_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert lines["main"] == "0" and lines["passing"] == "0"
    assert lines["engine"] == "2 2"  # the thread itself and its team's worker


def test_a_passing_thread_returns_and_raises_in_the_caller():
    assert in_passing_thread(lambda a, b=0: (threading.current_thread().name, a + b), 1, b=2) == ("scd-load", 3)
    with pytest.raises(ValueError, match="bad"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))
