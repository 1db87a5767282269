"""The README's main job: tritonserver + gateway started together, answering the demo request."""

import subprocess
import sys
from pathlib import Path

import soundfile as sf

from s2tts.server import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_launch_once_serves_the_demo_request(tiny_ckpt, tmp_path):
    port = free_port()
    # the device as the README's command leaves it (`auto`: the CPU here), so the defaults it runs are tested
    cmd = [sys.executable, "-m", "s2tts.launch", "--checkpoint", str(tiny_ckpt), "--once",
           "--port", str(port), "--grpc-port", str(free_port()), "--http-port", str(free_port()),
           "--metrics-port", str(free_port()), "--out-dir", str(tmp_path)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"OpenAI-compatible gateway: http://127.0.0.1:{port}" in p.stdout
    assert f"curl http://127.0.0.1:{port}/v1/audio/speech" in p.stdout
    assert f"web page (listen in a browser): http://127.0.0.1:{port}/" in p.stdout
    audio, sr = sf.read(tmp_path / "hello.wav")
    assert sr == 44100 and audio.ndim == 1 and len(audio) % 2048 == 0 and len(audio) > 0
    assert abs(audio).max() > 1e-4


def test_server_removes_its_temporary_folder_on_sigterm(tiny_ckpt):
    """`python -m s2tts.server` without --workdir renders into a temporary folder; a SIGTERM, here while the models
    load (the operator's stop during a start that takes minutes on a GPU), stops tritonserver at once and removes that
    folder (a SIGTERM after the ready line takes the same way out: `server.stop()`)."""
    import os
    import re
    import signal
    import time

    cmd = [sys.executable, "-m", "s2tts.server", "--checkpoint", str(tiny_ckpt), "--device", "cpu",
           "--grpc-port", str(free_port()), "--http-port", str(free_port()), "--metrics-port", str(free_port())]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        line = p.stdout.readline()  # "starting tritonserver: log <workdir>/tritonserver.log"
        m = re.search(r"starting tritonserver: log (\S+)/tritonserver\.log", line)
        assert m, line + p.stdout.read()[-2000:]
        workdir = m.group(1)
        assert os.path.isdir(workdir) and "s2tts-triton-" in workdir
        log, deadline = Path(workdir) / "tritonserver.log", time.time() + 120
        while "successfully loaded" not in (log.read_text(errors="replace") if log.exists() else "") \
                and time.time() < deadline:  # a model loaded, the others' processes running
            time.sleep(0.1)
        assert "successfully loaded" in log.read_text(errors="replace")
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, p.stdout.read()[-2000:]
        stubs = subprocess.run(["pgrep", "-f", f"{workdir}/"], capture_output=True, text=True).stdout.split()
        assert stubs == [], stubs  # tritonserver and every model process ended
        deadline = time.time() + 10
        while os.path.exists(workdir) and time.time() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(workdir), os.listdir(workdir)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)


def test_stopping_a_dead_server_ends_its_model_processes(tiny_ckpt, tmp_path):
    """tritonserver killed outright (as when it aborts): stop() still ends the model processes it left behind. A
    stub notices its parent's death by itself only if it is not stuck; here one is stopped (SIGSTOP) to stand for
    a stuck one (one was left so, holding memory, after an abort in CI)."""
    import os
    import signal
    import time

    from s2tts.server import TritonServer

    # two of the models are enough to stand for all (each is one Python backend stub), and start in half the time
    server = TritonServer(tiny_ckpt, {"device": "cpu", "dtype": "fp32"}, free_port(), free_port(), free_port(),
                          workdir=tmp_path / "w", models=("dac_encoder", "fast_ar"))
    server.start(timeout=300)

    def stubs():
        out = subprocess.run(["pgrep", "-f", f"{tmp_path / 'w'}/model_repository/"], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    left = []
    try:
        assert len(stubs()) == 2  # one Python backend stub per model
        os.kill(stubs()[0], signal.SIGSTOP)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
        server.stop()
        deadline = time.time() + 10
        while stubs() and time.time() < deadline:
            time.sleep(0.2)
        left = stubs()
    finally:
        for pid in stubs():  # whatever the outcome, leave nothing behind
            os.kill(pid, signal.SIGKILL)
    assert not left, f"model processes left after stop(): {left}"


def test_free_port_never_hands_out_a_port_twice():
    """A server's three ports (and a test's) come from free_port one after another: the OS may offer the same free
    port to two calls in a row, which made a launch fail ("cannot listen to GRPC and metrics at the same address")."""
    from s2tts.server import free_port

    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports) and all(0 < p < 65536 for p in ports)


def test_free_port_keeps_to_its_share(monkeypatch):
    """S2TTS_PORT_SHARE="i/n" (what each of the suite's parallel workers gets): only ports p with (p // 2) % n == i,
    so that two processes picking ports at once never pick the same one."""
    from s2tts.server import free_port

    for share in ("0/2", "1/2", "2/3"):
        monkeypatch.setenv("S2TTS_PORT_SHARE", share)
        i, n = map(int, share.split("/"))
        ports = [free_port() for _ in range(20)]
        assert all((p // 2) % n == i for p in ports) and len(set(ports)) == len(ports), (share, ports)
