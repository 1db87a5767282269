"""perf/cpu_use.py: the CPU time of the load's processes, read from /proc while they run."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_use_counts_a_perf_script_that_spins(tmp_path):
    """A script under a perf/ folder that keeps a CPU busy is found by its name and its CPU time counted, the busy
    thread by the name `serving.threads.guarded` gave it where the OS shows it (as the engine's and sender's), the
    worker process it spawned (as loadgen's `--procs`) counted with it; a process
    that is not of the load (the sleeping one) is left out; the machine's busy share is a fraction. (A server
    another test runs meanwhile may be listed too: tritonserver and its models' stubs are what it looks for.)"""
    (tmp_path / "perf").mkdir()
    spin = tmp_path / "perf" / "spin.py"
    spin.write_text(textwrap.dedent(f"""
        import multiprocessing as mp, os, sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from s2tts.serving.threads import guarded

        def child(parent):  # a spawned worker, as loadgen's --procs makes: it lives while its parent does
            while os.getppid() == parent:
                time.sleep(0.05)

        if __name__ == "__main__":
            stop, t0 = threading.Event(), time.monotonic()
            def body():
                while time.monotonic() - t0 < 30:
                    pass
                stop.set()
            threading.Thread(target=guarded("spinner", body, stop, print), name="s2tts-spinner").start()
            mp.get_context("spawn").Process(target=child, args=(os.getpid(),)).start()
            open({str(tmp_path / "started")!r}, "w").close()
    """))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    spinner = subprocess.Popen([sys.executable, str(spin)])
    try:
        for _ in range(600):  # its worker process started (not a timing assertion: up to 60 s on a busy machine)
            if (tmp_path / "started").exists():
                break
            time.sleep(0.1)
        out = tmp_path / "cpu.json"
        p = subprocess.run([sys.executable, str(ROOT / "perf" / "cpu_use.py"), "--seconds", "1.5", "--interval", "0.2",
                            "--json", str(out), "--markdown", str(tmp_path / "cpu.md")],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
    finally:
        spinner.kill()
        sleeper.kill()
    rep = json.loads(out.read_text())
    assert "spin" in rep["cores"] and not any(k.startswith("python") or k == "-c" for k in rep["cores"]), rep
    assert rep["processes"]["spin"] == 2, rep  # the spawned worker counted with its script
    assert 0 < rep["cores"]["spin"] <= 1.05 and 0 < rep["busy"] <= 1 and rep["cpus"] >= 1, rep
    assert rep["top_threads"]["spin"][0][0].startswith("s2tts-spinner/") and rep["top_threads"]["spin"][0][1] > 0, rep
    assert "| spin (2 processes) |" in (tmp_path / "cpu.md").read_text() and "| spin (2 processes) |" in p.stdout
