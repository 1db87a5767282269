"""perf/cpu_use.py: the CPU time of the load's processes, read from /proc while they run."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_use_counts_a_perf_script_that_spins(tmp_path):
    """A script under a perf/ folder that keeps a CPU busy is found by its name and its CPU time counted, the busy
    thread by the name `lifecycle.guarded` gave it where the OS shows it (as the engine's and sender's); a process
    that is not of the load (the sleeping one) is left out; the machine's busy share is a fraction. (A server
    another test runs meanwhile may be listed too: tritonserver and its models' stubs are what it looks for.)"""
    (tmp_path / "perf").mkdir()
    spin = tmp_path / "perf" / "spin.py"
    spin.write_text(textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(ROOT)!r})
        from s2tts.lifecycle import guarded
        stop, t0 = threading.Event(), time.monotonic()
        def body():
            while time.monotonic() - t0 < 30:
                pass
            stop.set()
        threading.Thread(target=guarded("spinner", body, stop, print), name="s2tts-spinner").start()
    """))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    spinner = subprocess.Popen([sys.executable, str(spin)])
    try:
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
    assert 0 < rep["cores"]["spin"] <= 1.05 and 0 < rep["busy"] <= 1 and rep["cpus"] >= 1, rep
    assert rep["top_threads"]["spin"][0][0].startswith("s2tts-spinner/") and rep["top_threads"]["spin"][0][1] > 0, rep
    assert "| spin |" in (tmp_path / "cpu.md").read_text() and "| spin |" in p.stdout
