"""The main job: tritonserver + the OpenAI-compatible gateway, answering a first request.

    python -m s2tts.launch                       # tiny checkpoint (written on first use), CPU or GPU
    python -m s2tts.launch --checkpoint /models/s2-pro --device cuda --set max_batch=64
    python -m s2tts.launch --once                # answer the demo request, then stop

Prints the gateway URL and a curl line; serves until Ctrl-C (or SIGTERM).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from .repository import REPO_ROOT
from .server import Cancelled, TritonServer, parse_settings

DEFAULT_TINY = REPO_ROOT / "checkpoints" / "tiny"


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def start_gateway(triton_url: str, host: str, port: int, db: Path, api_key: str | None = None,
                  max_in_flight: int | None = None, log_path: Path | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "s2tts.gateway", "--triton-url", triton_url, "--host", host, "--port", str(port), "--db", str(db)]
    if api_key:
        cmd += ["--api-key", api_key]
    if max_in_flight:
        cmd += ["--max-in-flight", str(max_in_flight)]
    out = open(log_path, "ab") if log_path else None
    return subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)


def demo_request(base: str, out: Path, api_key: str | None) -> dict:
    body = json.dumps({"model": "s2-pro", "input": "Hello from S2 Pro on Triton.", "voice": "default",
                       "response_format": "wav", "seed": 1, "max_new_tokens": 64, "stream": False}).encode()
    req = urllib.request.Request(f"{base}/v1/audio/speech", data=body, headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        data = r.read()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    import soundfile as sf

    info = sf.info(str(out))
    return {"file": str(out), "bytes": len(data), "sample_rate": info.samplerate, "seconds": round(info.duration, 3),
            "request_s": round(time.perf_counter() - t0, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m s2tts.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help=f"S2 Pro checkpoint directory (default: a tiny random one at {DEFAULT_TINY})")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model repository setting (see README)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="gateway port")
    ap.add_argument("--triton-address", help="where tritonserver's ports listen (default 127.0.0.1; the gateway is "
                                             "the public door, --host sets its address)")
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "out"), help="logs, the rendered repository, the demo WAV")
    ap.add_argument("--db", help="voice database (SQLite; default OUT_DIR/voices.sqlite3)")
    ap.add_argument("--api-key", default=os.environ.get("S2TTS_API_KEY"))
    ap.add_argument("--once", action="store_true", help="stop after the demo request")
    args = ap.parse_args(argv)
    # first: a SIGTERM at any time (`docker stop` while the models load: this process may be a container's PID 1,
    # which the default action does not end) stops everything the same way out
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))

    ckpt = Path(args.checkpoint) if args.checkpoint else DEFAULT_TINY
    if not args.checkpoint and not (ckpt / "config.json").is_file():
        from .random_checkpoint import (
            write_checkpoint,  # here only: writing one imports torch
        )

        print(f"no --checkpoint given: writing a tiny random S2-shaped checkpoint to {ckpt}", flush=True)
        write_checkpoint(ckpt, "tiny", seed=0)
    logs = Path(args.out_dir)
    logs.mkdir(parents=True, exist_ok=True)
    db = Path(args.db) if args.db else logs / "voices.sqlite3"
    settings = parse_settings(args.set)
    settings.setdefault("device", args.device)
    if args.triton_address:
        settings["address"] = args.triton_address
    server = TritonServer(ckpt, settings, args.http_port, args.grpc_port, args.metrics_port, workdir=logs / "triton")
    gateway = None
    try:
        t0 = time.monotonic()
        took = "the tiny checkpoint: about half a minute" if not args.checkpoint else \
            "a full checkpoint on a GPU: a few minutes (weights, CUDA graphs)"
        print(f"starting tritonserver: loading the {len(server.models)} models of the repository on {settings['device']} "
              f"({took}; log {server.log_path})", flush=True)
        server.start(timeout=900, cancelled=lambda: stop["now"])
        print(f"tritonserver ready in {time.monotonic() - t0:.1f} s (gRPC {server.grpc_url}, log {server.log_path})", flush=True)
        print("starting the gateway and sending the demo request", flush=True)
        gateway = start_gateway(server.grpc_url, args.host, args.port, db, args.api_key, log_path=logs / "gateway.log")
        base = f"http://{args.host}:{args.port}"
        wait_http(f"{base}/health", 120, gateway)
        result = demo_request(base, logs / "hello.wav", args.api_key)
        print(f"demo request answered: {json.dumps(result)}", flush=True)
        auth = f" -H 'Authorization: Bearer {args.api_key}'" if args.api_key else ""
        print(f"\nweb page (listen in a browser): {base}/")
        print(f"OpenAI-compatible gateway: {base}\n  curl {base}/v1/audio/speech{auth} -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"s2-pro\", \"input\": \"Hello!\", \"voice\": \"default\", \"response_format\": \"wav\"}}' -o hello.wav\n",
              flush=True)
        if args.once:
            return 0
        while not stop["now"] and server.proc.poll() is None and gateway.poll() is None:
            time.sleep(0.5)
        if not stop["now"]:  # one of them died: a failure (a container's restart policy acts on it)
            dead, log = (("tritonserver", server.log_path) if server.proc.poll() is not None
                         else ("the gateway", logs / "gateway.log"))
            print(f"error: {dead} exited on its own (log {log})", file=sys.stderr)
            return 1
        return 0
    except (KeyboardInterrupt, Cancelled):
        return 0
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if gateway and gateway.poll() is None:
            os.killpg(gateway.pid, signal.SIGTERM)
            try:
                gateway.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(gateway.pid, signal.SIGKILL)
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
