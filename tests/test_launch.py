"""The README's main job: tritonserver + gateway started together, answering the demo request."""

import subprocess
import sys
from pathlib import Path

import soundfile as sf

from s2tts.server import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_launch_once_serves_the_demo_request(tiny_ckpt, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "s2tts.launch", "--checkpoint", str(tiny_ckpt), "--device", "cpu", "--once",
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
