"""Start `tritonserver` on this project's model repository and wait until it is ready.

    python -m s2tts.server --checkpoint checkpoints/tiny            # CPU or GPU, chosen by --device
    python -m s2tts.server --checkpoint /models/s2-pro --device cuda --set max_batch=64

The model repository's `config.pbtxt` files hold `${name}` placeholders for their
settings; `s2tts.repository` fills the ones given (the rest keep the defaults in the models'
code) into a copy of the repository, switching `backend` if asked, and this serves that copy.
The server binary is the one of the official container (`/opt/tritonserver`) when present,
else the one in the `nvidia-pytriton` wheel from PyPI.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable

from .repository import MODELS, REPO_ROOT, render_model_repository
from .sizing import with_gpu_sizes
from .settings import SCHEMA


def find_server() -> tuple[Path, Path, Path | None]:
    """(tritonserver binary, directory with the python backend files, extra library dir or None).

    Looked for in $S2TTS_TRITON_HOME (bin/, backends/python/, python_backend_stubs/, lib/), then the
    official container's /opt/tritonserver, then the `nvidia-pytriton` wheel.
    """
    home = os.environ.get("S2TTS_TRITON_HOME")
    if home:
        h = Path(home)
        if not (h / "bin" / "tritonserver").is_file():
            raise RuntimeError(f"S2TTS_TRITON_HOME={home} has no bin/tritonserver")
        return h / "bin" / "tritonserver", h, h / "lib" if (h / "lib").is_dir() else None
    container = Path("/opt/tritonserver")
    if (container / "bin" / "tritonserver").is_file():
        return container / "bin" / "tritonserver", container / "backends" / "python", None

    spec = importlib.util.find_spec("pytriton")  # located, not imported: its client needs more packages
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("no tritonserver found: install the `server` extra (pip install 'nvidia-pytriton==0.7.0') "
                           "or run inside the nvcr.io/nvidia/tritonserver container")
    pkg = Path(list(spec.submodule_search_locations)[0])
    libs = pkg.parent / "nvidia_pytriton.libs"
    return pkg / "tritonserver" / "bin" / "tritonserver", pkg / "tritonserver", libs if libs.is_dir() else None


def server_has_tensorrt() -> bool:
    """Whether the tritonserver `find_server` picks has the TensorRT backend (the NGC container has it;
    the nvidia-pytriton wheel has only the Python backend)."""
    try:
        binary, src, _ = find_server()
    except RuntimeError:
        return False
    candidates = [src.parent / "tensorrt", src / "backends" / "tensorrt", binary.parent.parent / "backends" / "tensorrt"]
    return any(c.is_dir() for c in candidates)


def backend_dir(work: Path) -> Path:
    """A --backend-directory holding the python backend for this interpreter's version."""
    binary, src, _ = find_server()
    if src.name == "python" and (src / "triton_python_backend_stub").is_file():
        return src.parent  # the container's own backends directory
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = src / "python_backend_stubs" / ver / "triton_python_backend_stub"
    if not stub.is_file():
        raise RuntimeError(f"the tritonserver wheel has no python backend stub for Python {ver}")
    dst = work / "backends" / "python"
    dst.mkdir(parents=True, exist_ok=True)
    for f in (src / "backends" / "python" / "libtriton_python.so", src / "backends" / "python" / "triton_python_backend_utils.py", stub):
        target = dst / f.name
        if not target.exists():
            shutil.copy2(f, target)
    return dst.parent


_GIVEN: set[int] = set()  # ports free_port handed out in this process


def free_port() -> int:
    """A port free now on 127.0.0.1, never one this process was given before (the OS may hand the same free port
    to two calls in a row: a server's three ports, or a test's, must differ). With S2TTS_PORT_SHARE="i/n" in the
    environment only ports p with (p // 2) % n == i (Linux's bind hands out even ports first): processes that pick
    ports at the same time (the test suite's parallel workers) then never pick the same one."""
    share = os.environ.get("S2TTS_PORT_SHARE", "")
    i, n = (int(x) for x in share.split("/")) if share else (0, 1)
    for _ in range(100 * n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if (port // 2) % n == i and port not in _GIVEN:
            _GIVEN.add(port)
            return port
    raise RuntimeError("no free port on 127.0.0.1 that this process has not used already")


def python_backend_threads(settings: dict) -> int:
    """Threads per model instance for the Python backend (`--backend-config=python,thread-pool-size=N`). A BLS
    call holds one of these for its whole wait, and the responses a model sends go through the same pool
    (python_be.cc: ExecuteBLSRequest blocks on the call's future; ResponseSendDecoupled is queued there too).
    s2pro has up to `max_concurrent_requests` calls waiting on slow_ar at once, one per request: with the
    default 32 threads its responses to clients and its control calls queue behind them under load (the playing
    streams stall while a burst waits for KV slots). So: one thread per request, plus the default 32 for the sends
    and control calls."""
    return _setting(settings, "max_concurrent_requests") + 32


def _setting(settings: dict, key: str):
    """A setting's value as given (typed) or its schema default."""
    setting, raw = SCHEMA[key], settings.get(key)
    return setting.default if raw in (None, "") else setting.parse(raw)


SHM_POOL_BYTES = 2**20  # the pool a Python backend model process maps in /dev/shm at start (shm-default-byte-size)


def shared_memory_need(settings: dict, models: int) -> tuple[int, int]:
    """(bytes to start and serve a request, bytes to serve `max_concurrent_requests` at once) of /dev/shm, where
    tritonserver's Python backend passes tensors to and between its model processes: each maps a pool there at start
    and grows it as a request needs, never shrinking it; a reference clip (float32 at S2 Pro's 44.1 kHz, up to
    `max_reference_seconds`) passes through about four pools on its way to dac_encoder."""
    clip = 4 * int(_setting(settings, "max_reference_seconds") * 44100 * 4)
    start = models * SHM_POOL_BYTES + clip
    return start, start + (_setting(settings, "max_concurrent_requests") - 1) * clip


def check_shared_memory(settings: dict, models: int, path: str | Path = "/dev/shm") -> str | None:
    """Refuse to start (RuntimeError) when `path` has less free space than `shared_memory_need`'s first figure; a
    warning to print when it has less than the second: checked before tritonserver starts rather than found short by
    a request."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None  # no /dev/shm to measure: tritonserver says what it lacks
    free, (start, load) = st.f_bavail * st.f_frsize, shared_memory_need(settings, models)

    def mib(n: int) -> str:
        return f"{n / 2**20:.0f} MiB"

    flag = f"--shm-size={max(1, -(-load // 2**30))}g"
    if free < start:
        raise RuntimeError(
            f"{path} has {mib(free)} free; tritonserver's Python backend needs at least {mib(start)} there for "
            f"{models} models and one request with a reference clip: give it more shared memory (docker run "
            f"{flag}; compose: shm_size; Kubernetes: an emptyDir of medium Memory mounted on /dev/shm)")
    if free < load:
        return (f"warning: {path} has {mib(free)} free, less than the {mib(load)} that max_concurrent_requests="
                f"{_setting(settings, 'max_concurrent_requests')} requests with reference clips can take at once; "
                f"requests may fail under load: give it more (docker run {flag}) or lower max_concurrent_requests")
    return None


class Cancelled(Exception):
    """`TritonServer.start` was cancelled before the server was ready; the server is stopped."""


class TritonServer:
    """A running tritonserver process on a rendered copy of the model repository."""

    def __init__(self, checkpoint: str | Path | None, settings: dict[str, str] | None = None, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None, workdir: str | Path | None = None,
                 log_path: str | Path | None = None, models=MODELS, verbose: bool = False):
        """`checkpoint` None: only for `start(repository=...)`, a model repository of one's own."""
        self.settings = {**({"checkpoint": str(Path(checkpoint).resolve())} if checkpoint else {}), **(settings or {})}
        # where the HTTP, gRPC and metrics ports listen: this machine only unless the `address` setting says otherwise
        self.address = str(self.settings.get("address") or SCHEMA["address"].default)
        self.http_port = http_port or free_port()
        self.grpc_port = grpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.own_workdir = workdir is None  # a temporary folder of ours: removed by stop()
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="s2tts-triton-"))
        self.log_path = Path(log_path) if log_path else self.workdir / "tritonserver.log"
        self.models = models
        self.verbose = verbose
        self.proc: subprocess.Popen | None = None

    @property
    def host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "::", "") else self.address

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def start(self, timeout: float = 300.0, cancelled: Callable[[], bool] | None = None,
              repository: str | Path | None = None) -> "TritonServer":
        """Render the repository, start tritonserver and wait until it is ready (at most `timeout` s). `cancelled`
        (polled while waiting): True stops the server and raises `Cancelled` (a SIGTERM while the models load).
        `repository`: serve that model repository as it is instead (a repository of one's own models)."""
        if repository is not None:
            repo = Path(repository)
        elif "checkpoint" not in self.settings:
            raise ValueError("TritonServer needs a checkpoint to render the model repository from (or a repository)")
        else:  # the `backend` switch: python | tensorrt | onnxruntime (tensorrt only on a server that has it)
            self.settings, sized = with_gpu_sizes(self.settings)  # the sizes no setting gives, from the GPU
            if sized:
                print(sized, flush=True)
            repo = render_model_repository(self.workdir / "model_repository", self.settings, models=self.models,
                                           has_tensorrt=server_has_tensorrt)
        try:
            warning = check_shared_memory(self.settings, _models_in(repo))
        except RuntimeError:  # refused: nothing started, and a temporary folder of ours goes
            if self.own_workdir:
                shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        if warning:
            print(warning, file=sys.stderr, flush=True)
        binary, _, libs = find_server()
        cmd = self.command(binary, repo)
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # the stub finds this venv's packages
        env["PYTHONPATH"] = f"{REPO_ROOT}:{env.get('PYTHONPATH', '')}"
        env.setdefault("PYTHONUTF8", "1")
        if libs:
            env["LD_LIBRARY_PATH"] = f"{libs}:{env.get('LD_LIBRARY_PATH', '')}"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.wait_ready(timeout, cancelled)
        return self

    def command(self, binary, repo) -> list[str]:
        """The tritonserver command line for the rendered repository `repo`."""
        return [str(binary), f"--model-repository={repo}", f"--backend-directory={backend_dir(self.workdir)}",
                f"--http-address={self.address}", f"--grpc-address={self.address}", f"--metrics-address={self.address}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
                "--allow-metrics=true", "--log-verbose=1" if self.verbose else "--log-verbose=0",
                "--exit-on-error=true", "--strict-readiness=true",
                # the configs are complete: without this the Python backend starts a process per model that imports
                # its model.py (torch included) only to ask it to complete its config, before the model's real one
                "--disable-auto-complete-config",
                f"--backend-config=python,thread-pool-size={python_backend_threads(self.settings)}",
                # explicit control: a model that fails for good unloads itself (readiness turns false) and s2pro
                # can load it again (auto_recover); every model is loaded at start, all at once (Triton's default
                # of 4 threads kept the engine, the slowest to load, waiting for the others: 2 s of 11 on the CPU)
                "--model-control-mode=explicit", "--load-model=*",
                f"--model-load-thread-count={max(4, _models_in(repo))}"]

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float, cancelled: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}; log:\n{self.log_tail()}")
            if self.is_ready():
                return
            if cancelled is not None and cancelled():
                self.stop()
                raise Cancelled("stopped while the models were loading")
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout:.0f} s; log:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to tritonserver and its model processes (one process group), SIGKILL after `timeout`; model
        processes that outlive tritonserver (it exits without waiting for them when stopped while they load, or when
        it died) get 5 s to exit by themselves, then SIGKILL: nothing of the server is left running."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            _end_group(self.proc.pid, grace=5.0)
        elif self.proc is not None:  # tritonserver died (an abort, a kill): its model processes, in its process
            _end_group(self.proc.pid, grace=0.0)  # group, may live on without it
        if getattr(self, "_log", None):
            self._log.close()
        if self.own_workdir and self.proc is not None and self.proc.poll() is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _models_in(repo: str | Path) -> int:
    return sum(1 for d in Path(repo).iterdir() if (d / "config.pbtxt").exists())


def _end_group(pgid: int, grace: float) -> None:
    """Wait up to `grace` s for the processes of group `pgid` to exit, then SIGKILL those left."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def parse_settings(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: use key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m s2tts.server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="S2 Pro checkpoint directory")
    ap.add_argument("--device", help="auto (default), cpu, cuda, cuda:N, or a list (cuda:0,cuda:1: one engine per GPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help=f"a setting (docs/SETTINGS.md; s2tts/settings.py); one of: {', '.join(sorted(SCHEMA))}")
    ap.add_argument("--address", help="where the HTTP, gRPC and metrics ports listen (default 127.0.0.1: this machine "
                                      "only; 0.0.0.0 exposes them, without authentication)")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--workdir", help="where the rendered repository and the log go (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for readiness")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # before anything can be printed: a SIGTERM sent as soon as the "ready" line shows must find the handler, or the
    # default action kills this process and leaves tritonserver and the rendered folder behind
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        settings = parse_settings(args.set)
        if args.device:
            settings["device"] = args.device
        if args.address:
            settings["address"] = args.address
        server = TritonServer(args.checkpoint, settings, args.http_port, args.grpc_port, args.metrics_port, args.workdir)
        t0 = time.monotonic()
        print(f"starting tritonserver: log {server.log_path}", flush=True)
        server.start(args.timeout, cancelled=lambda: stop["now"])  # a SIGTERM while loading stops it at once
    except Cancelled:
        return 0
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"tritonserver ready in {time.monotonic() - t0:.1f} s: gRPC {server.grpc_url}, HTTP {server.http_url}, "
          f"log {server.log_path}", flush=True)
    try:
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    server.stop()
    return 0 if server.proc.returncode in (0, -signal.SIGTERM, None) else server.proc.returncode


if __name__ == "__main__":
    sys.exit(main())
