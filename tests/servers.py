"""Real server processes for tests: tritonserver with the model repository on the tiny checkpoint (CPU), and the
gateway (`python -m s2tts.gateway`) in front of it."""

import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from s2tts.server import free_port  # noqa: F401 - tests import it from here too

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def tiny_server(ckpt, workdir, stop_timeout: float = 10, **settings):
    """A started server (fp32 on the CPU unless `settings` say otherwise), stopped on exit (`stop_timeout`: the
    grace tritonserver gets for its models to unload)."""
    from s2tts.server import TritonServer

    server = TritonServer(ckpt, {"device": "cpu", "dtype": "fp32", **{k: str(v) for k, v in settings.items()}},
                          workdir=workdir)
    server.upstream_aborts = 0  # aborts of the kind UPSTREAM_ABORT that a test provoked and handled (see there)
    server.start(timeout=300)
    try:
        yield server
    finally:
        # 10 s, not tritonserver's 30 s of grace: a server whose model processes were killed keeps their unfinished
        # requests (and so those models) forever, and tritonserver waits the whole grace for them
        server.stop(timeout=stop_timeout)
        # a model process that crashed (while serving or at unload) leaves faulthandler's report in the log
        log = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
        allowed, aborted = server.upstream_aborts, False
        for crash in re.finditer(r"Fatal Python error|Signal \((?!15\)|2\))\d+\) received", log):  # a model's, or tritonserver's
            i = crash.start()
            if allowed and UPSTREAM_ABORT in log[max(0, i - 500):i]:
                allowed, aborted = allowed - 1, True
                continue
            if aborted and ORPHAN_STUB in log[max(0, i - 1500):i]:  # a stub of the aborted server, left without it
                continue
            raise AssertionError(f"a server process crashed ({server.log_path}):\n{log[max(0, i - 2000):i + 3000]}")


# Triton 24.10's Python backend: when a model's stub process is killed while it holds a lock of the shared memory
# it shares with tritonserver, tritonserver itself aborts with this (triton-inference-server/server#8882,
# python_backend#446). Tests that SIGKILL a model process meet it now and then; they restart the server, try
# again, and count it (`upstream_aborts`) so that tiny_server's crash check accepts exactly those.
UPSTREAM_ABORT = "boost::interprocess::lock_exception"
# ... after which the aborted server's other stubs, left without their parent, may segfault on the way out
# (python_backend#446) and print faulthandler's report after this line of theirs.
ORPHAN_STUB = "Non-graceful termination detected"


class Gateway:
    """`python -m s2tts.gateway` in a subprocess on a free port."""

    def __init__(self, triton_url: str, db: Path, log: Path, *extra: str, wait_healthy: bool = True,
                 port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "ab")
        cmd = [sys.executable, "-m", "s2tts.gateway", "--triton-url", triton_url, "--host", "127.0.0.1",
               "--port", str(self.port), "--db", str(db), *extra]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"gateway exited:\n{self.log_tail()}"
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
                if r.status_code == 200 or not wait_healthy:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway not healthy after 60 s:\n{self.log_tail()}")

    def client(self, api_key: str = "unused", **kw):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300, **kw)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def log_tail(self, n: int = 80) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def log_showing(proc, text: str, timeout: float = 30.0, lines: int = 400) -> str:
    """The last `lines` of `proc`'s log (a server's or a gateway's `log_tail`) once they hold `text`, or as they are
    after `timeout` seconds."""
    deadline = time.time() + timeout
    while text not in (tail := proc.log_tail(lines)) and time.time() < deadline:
        time.sleep(0.2)
    return tail


def infer_inputs(arrays: dict) -> list:
    """tritonclient gRPC inputs from {name: numpy array}, each typed by its array's dtype."""
    import tritonclient.grpc as g
    from tritonclient.utils import np_to_triton_dtype

    out = []
    for name, a in arrays.items():
        t = g.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype))
        t.set_data_from_numpy(a)
        out.append(t)
    return out


def pipeline_calls(metrics: dict, call: str) -> tuple[float, float]:
    """(count, sum of seconds) of s2pro's histogram of its calls out of its process (`s2tts_pipeline_call_seconds`)
    for one kind of call, from `s2tts.client.read_metrics`."""
    got = [(k, v) for k, v in metrics.items() if k.startswith("s2tts_pipeline_call_seconds_") and f'call="{call}"' in k
           and 'model="s2pro"' in k]
    return (sum(v for k, v in got if k.startswith("s2tts_pipeline_call_seconds_count")),
            sum(v for k, v in got if k.startswith("s2tts_pipeline_call_seconds_sum")))


def assert_together_as_alone(server, texts, seeds, max_new_tokens=20):
    """Each request gives the same codes and audio when run alone and when all run at once (batched in one engine,
    their chunks decoded side by side); returns the solo results."""
    import threading

    import numpy as np

    from s2tts.client import S2ProClient, TTSInput

    def synth(i):
        with S2ProClient(server.grpc_url) as c:
            return c.synthesize(TTSInput(text=texts[i], seed=seeds[i], max_new_tokens=max_new_tokens))

    alone = [synth(i) for i in range(len(texts))]
    together = [None] * len(texts)
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, synth(i))) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for a, b in zip(alone, together):
        np.testing.assert_array_equal(a.codes, b.codes)
        np.testing.assert_allclose(a.audio, b.audio, atol=2e-4, rtol=0)
    return alone


KILLED_CLIENT = """
import sys
from s2tts.client import S2ProClient, TTSInput
c = S2ProClient(sys.argv[1])
for ev in c.stream(TTSInput(text="A client that dies part way through.", seed=5, max_new_tokens=400, ignore_eos=True,
                            first_chunk_frames=2, chunk_frames=2), request_id=sys.argv[2]):
    print("chunk", flush=True)
    break
input()  # wait, connection open, for the kill
"""


def _cancelled(server) -> tuple[int, int]:
    from s2tts.client import read_metrics

    m = read_metrics(server.metrics_url)
    return tuple(int(m.get(f's2tts_requests_finished_total{{model="{model}",outcome="cancelled"}}', 0))
                 for model in ("s2pro", "slow_ar"))


def settled(read, every_s: float = 0.2, tries: int = 25):
    """`read()` once two reads `every_s` apart agree (at most `tries` more): what the models report on their ticks,
    with an earlier test's last observations no longer on their way."""
    last = read()
    for _ in range(tries):
        time.sleep(every_s)
        now = read()
        if now == last:
            return now
        last = now
    return last


def cancelled_counts(server) -> tuple[int, int]:
    """(requests s2pro ended as cancelled, engine requests slow_ar ended as cancelled), from Triton's /metrics, once
    they hold still."""
    return settled(lambda: _cancelled(server))


def cancelled_since(server, before: tuple[int, int], timeout: float = 30.0) -> tuple[int, int]:
    """How many more requests s2pro and slow_ar have ended as cancelled than `before` (`cancelled_counts`), once both
    have (the models report on their ticks), or as they stand after `timeout`."""
    deadline = time.time() + timeout
    while True:
        now = _cancelled(server)
        if all(n > b for n, b in zip(now, before)) or time.time() > deadline:
            return now[0] - before[0], now[1] - before[1]
        time.sleep(0.1)


def assert_killed_client_is_cancelled(server, rid: str) -> None:
    """A client process killed while it streams (its connection drops, nothing cancelled): s2pro and the engine end
    the request as cancelled (not after its 400 frames, as `length`), and a next request completes."""
    from s2tts.client import S2ProClient, TTSInput

    before = cancelled_counts(server)
    p = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, server.grpc_url, rid], stdout=subprocess.PIPE,
                         stdin=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "chunk"
    finally:
        p.kill()
        p.wait()
    assert cancelled_since(server, before) == (1, 1)
    with S2ProClient(server.grpc_url) as c:
        res = c.synthesize(TTSInput(text="The next request completes.", seed=4, max_new_tokens=10))
    assert res.stats["finish_reason"] in ("end", "length")


@contextmanager
def gateway_in(triton_url: str, folder: Path, *extra: str):
    """A gateway with its voice database and log in `folder` (`extra`: its command-line options), stopped on exit."""
    g = Gateway(triton_url, folder / "voices.sqlite3", folder / "gateway.log", *extra)
    try:
        yield g
    finally:
        g.stop()
