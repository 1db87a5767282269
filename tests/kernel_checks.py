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


def start_checks(ckpt, nice: int = 0) -> list[subprocess.Popen]:
    """Start the groups' processes, their output in temporary files (`p.out`, `p.err`); `nice` > 0: at that lower
    scheduling priority."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    script = Path(__file__).with_name("interpreted_kernels.py")
    procs = []
    for group in GROUPS:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        p = subprocess.Popen([sys.executable, str(script), str(ckpt), *group], stdout=out, stderr=err, text=True,
                             env=env, preexec_fn=(lambda: os.nice(nice)) if nice else None)
        p.out, p.err = out, err
        procs.append(p)
    return procs
