"""Starting the interpreted kernel checks (tests/interpreted_kernels.py) for tests/test_kernels.py: in two
processes that run at once (the interpreter runs a kernel's programs one after another in Python, on one core), about
the same work in each. conftest.py starts them niced when the whole suite begins, so that they use the CPU time the
server tests leave idle (about 305 s of one core on a 2-core machine); run alone, the test starts them itself.

Each check writes its output and then its exit status into files of one folder (`Checks`), so that the test that
collects them may run in another process than the one that started them (pytest-xdist's workers: the controller
starts them and names the folder in `ENV` to its workers)."""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# two processes of about the same CPU time, so that neither runs on alone at the suite's end while a core idles
# (one by one on the 2-core machine: ops 53 s, codec 79, fp8 30, engine 60, invariant 84)
GROUPS = (("ops", "codec", "fp8"), ("engine", "invariant"))
BACKGROUND = pytest.StashKey["Checks"]()  # config.stash: the checks conftest.py started in this process
ENV = "S2TTS_KERNEL_CHECKS"  # the folder of checks started for the whole run (by pytest-xdist's controller)


def _lower_priority(nice: int) -> None:
    """In the child before it runs (in a session of its own): `nice` for the process, and for its scheduling group.
    Linux's autogroups (on by default) share the CPU between sessions first and apply a process's nice only within
    its session: a niced check in pytest's session still took half the CPU from a tritonserver starting in a session
    of its own (each server's start ran ~20 s instead of ~12 s while the checks ran). In a session of its own with
    its group's nice raised, a check takes only the CPU that the tests leave idle."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:  # absent without CONFIG_SCHED_AUTOGROUP: the nice is enough
            f.write(str(nice))
    except OSError:
        pass


class Checks:
    """The check processes of one folder: `<i>.out`, `<i>.err`, and `<i>.rc` (written when check i has ended)."""

    def __init__(self, folder: Path, procs: list[subprocess.Popen] | None = None):
        self.folder, self.procs = Path(folder), procs or []

    @classmethod
    def start(cls, nice: int = 0) -> "Checks":
        """Write a tiny checkpoint of their own into a new temporary folder and start the groups' processes; `nice`
        > 0: at that lower scheduling priority (`_lower_priority`)."""
        from s2tts.random_checkpoint import write_checkpoint

        folder = Path(tempfile.mkdtemp(prefix="s2tts-kernel-checks-"))
        ckpt = write_checkpoint(folder / "tiny", "tiny", seed=0)
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        script = Path(__file__).with_name("interpreted_kernels.py")
        procs = []
        for i, group in enumerate(GROUPS):
            # the shell writes the check's exit status once it has ended: any process can wait for it
            cmd = ['"$0" "$@" >"$OUT" 2>"$ERR"; echo $? >"$RC.tmp" && mv "$RC.tmp" "$RC"', sys.executable,
                   str(script), str(ckpt), *group]
            procs.append(subprocess.Popen(["sh", "-c", *cmd], env=dict(env, OUT=str(folder / f"{i}.out"),
                                                                       ERR=str(folder / f"{i}.err"),
                                                                       RC=str(folder / f"{i}.rc")),
                                          start_new_session=True,
                                          preexec_fn=(lambda: _lower_priority(nice)) if nice else None))
        return cls(folder, procs)

    def wait(self, timeout: float = 900) -> list[tuple[int, str, str]]:
        """(exit status, stdout, stderr) of each check once all have ended; TimeoutError after `timeout` s."""
        deadline = time.monotonic() + timeout
        rcs = [self.folder / f"{i}.rc" for i in range(len(GROUPS))]
        while not all(f.exists() for f in rcs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the kernel checks in {self.folder} did not end within {timeout:.0f} s")
            time.sleep(0.5)
        return [(int(rc.read_text()), (self.folder / f"{i}.out").read_text(errors="replace"),
                 (self.folder / f"{i}.err").read_text(errors="replace")) for i, rc in enumerate(rcs)]

    def stop(self) -> None:
        """Kill checks still running (started for a test that did not run: -x, -k, an interrupted run) and remove
        the folder."""
        import shutil

        for p in self.procs:
            if p.poll() is None:
                # the shell and its check: a session, so a process group, of their own
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
