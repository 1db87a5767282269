"""Starting the interpreted kernel checks (tests/interpreted_kernels.py) for tests/test_kernels.py: in two
processes that run at once (the interpreter runs a kernel's programs one after another in Python, on one core), about
the same work in each. conftest.py starts them niced when the whole suite begins, so that they use the CPU time the
server tests leave idle (about 210 s of one core on a 2-core machine); run alone, the test starts them itself."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

GROUPS = (("ops", "codec", "fp8"), ("engine", "invariant"))
BACKGROUND = pytest.StashKey[list]()  # config.stash: the processes conftest.py started


def _lower_priority(nice: int) -> None:
    """In the child before it runs: `nice` for the process, and for its scheduling group. Linux's autogroups (on by
    default) share the CPU between sessions first and apply a process's nice only within its session: a niced check
    in pytest's session still took half the CPU from a tritonserver starting in a session of its own (each server's
    start ran ~20 s instead of ~12 s while the checks ran). In a session of its own with its group's nice raised, a
    check takes only the CPU that the tests leave idle."""
    os.setsid()
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:  # absent without CONFIG_SCHED_AUTOGROUP: the nice is enough
            f.write(str(nice))
    except OSError:
        pass


def start_checks(ckpt, nice: int = 0) -> list[subprocess.Popen]:
    """Start the groups' processes, their output in temporary files (`p.out`, `p.err`); `nice` > 0: at that lower
    scheduling priority (`_lower_priority`)."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = Path(__file__).with_name("interpreted_kernels.py")
    procs = []
    for group in GROUPS:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        p = subprocess.Popen([sys.executable, str(script), str(ckpt), *group], stdout=out, stderr=err, text=True,
                             env=env, preexec_fn=(lambda: _lower_priority(nice)) if nice else None)
        p.out, p.err = out, err
        procs.append(p)
    return procs
