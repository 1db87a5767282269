import faulthandler
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# One compute thread per process: a test runs pytest, tritonserver and its four model processes, and the gateway on
# a 2-core machine, and PyTorch's threads (each process would take every core) then wait on one another: one test
# ran 172 s with the default, 38 s with this. Set before any test imports torch; server processes inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# pytest-xdist's workers (scripts/test.sh runs two) pick their servers' ports at the same time: each its own share of
# the ports (s2tts.server.free_port), inherited by the servers and scripts it starts
if os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["S2TTS_PORT_SHARE"] = (f"{int(os.environ['PYTEST_XDIST_WORKER'][2:])}/"
                                      f"{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny S2-shaped checkpoint directory (official layout), written once per test session."""
    from s2tts.random_checkpoint import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    """The tiny model in fp32 on the CPU (one per test module: engines made over it take its caches)."""
    from s2tts.ar.loading import load_model

    return load_model(tiny_ckpt, "cpu", "fp32")


@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    from s2tts.frontend.prompt_builder import PromptBuilder

    return PromptBuilder.from_dir(tiny_ckpt)


@pytest.fixture(scope="session")
def hum_wav() -> bytes:
    """1.5 s of a hummed tone at 24 kHz, as a WAV file's bytes (a reference clip; the encoder resamples)."""
    import io

    import numpy as np
    import soundfile as sf

    t = np.arange(int(24000 * 1.5)) / 24000
    x = 0.3 * np.sin(2 * np.pi * 180 * t + 2 * np.sin(2 * np.pi * 4 * t)) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), 24000, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@pytest.fixture
def s2_log(caplog):
    caplog.set_level(logging.INFO, logger="s2tts")
    return caplog


@pytest.fixture(scope="session")
def triton_server(tiny_ckpt, tmp_path_factory):
    """A real tritonserver process serving the model repository on the tiny checkpoint (CPU), with two s2pro instances
    (`s2pro_instances`, the default for two engines): every test here runs through both, whichever gets a request."""
    from servers import tiny_server

    # a short stop: the gateway's and the browser's cancels can race a request's end, which keeps s2pro from
    # unloading on Triton 24.10 until the grace ends; nothing is checked after
    with tiny_server(tiny_ckpt, tmp_path_factory.mktemp("triton"), stop_timeout=3, max_batch=8, max_seq_len=4096,
                     max_new_tokens_limit=3000, chunk_frames=8, s2pro_instances=2) as server:
        yield server


@pytest.fixture(scope="session")
def fault_server(tiny_ckpt, tmp_path_factory):
    """A server of tests/test_faults.py's own (its models get killed): quick stall checks, and a short stop
    (tritonserver holds a killed model process's unfinished requests, and so that model, to the end of its grace).
    Its AR matrices are FP8 (`ar_weights=fp8`), so that tests/test_fp8.py's served check runs here too instead of
    starting a server of its own (a start is ~25 s of CPU): what a fault does does not depend on the weights, and
    a model that s2pro reloads after a kill loads FP8 weights again."""
    from servers import tiny_server

    with tiny_server(tiny_ckpt, tmp_path_factory.mktemp("faults"), stop_timeout=3, max_batch=4, max_seq_len=2048,
                     stall_timeout_s=1, chunk_frames=4, first_chunk_frames=2, ar_weights="fp8") as server:
        yield server


@pytest.fixture
def harness_factory(tiny_ckpt, tmp_path):
    """make(**settings) -> a `fake_triton.FakeTriton` running the repository's real model.py files in this process
    (shut down at the end of the test)."""
    from fake_triton import FakeTriton, render

    made = []

    def make(**settings):
        h = FakeTriton(render(tiny_ckpt, tmp_path, **settings))
        made.append(h)
        return h

    yield make
    for h in made:
        h.shutdown()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server (Debian's package) for the session; `postgres.new_database()` gives a fresh one."""
    from postgres import find_bin, postgres_server

    if find_bin() is None:
        if os.environ.get("CI"):
            pytest.fail("CI needs Debian's postgresql package (.ci/run installs it)")
        pytest.skip("needs Debian's postgresql package: apt-get install postgresql")
    with postgres_server() as server:
        yield server


def _live_children() -> list[tuple[int, str]]:
    """This process's child processes that are still running (not zombies), from /proc."""
    me, out = os.getpid(), []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) == me and state != "Z":
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]))
        except (OSError, ValueError, IndexError):
            continue
    return out


# The `slow` tests, which the fast lane (`bash scripts/test.sh -m "not slow"`) leaves out: every test that uses a
# fixture starting a real server process (directly or through another fixture), and these modules: they start
# processes themselves (tritonserver, the gateway, a browser, Prometheus, the interpreted kernels, perf tools) or run
# the engine and codec for many steps.
SERVER_FIXTURES = {"triton_server", "fault_server", "postgres"}
SLOW_MODULES = {"test_codec", "test_codec_in_engine_server", "test_codec_start", "test_cpu_use", "test_dashboard",
                "test_determinism", "test_engine_codec", "test_export", "test_faults", "test_fish_api",
                "test_fish_server", "test_gateway", "test_kernels", "test_kubernetes", "test_launch", "test_launch_ahead",
                "test_layout", "test_lifecycle", "test_overlap_probe", "test_perf_harness", "test_soak", "test_triton",
                "test_web_page"}


def pytest_collection_modifyitems(session, config, items):
    """The `slow` marker as above. The container tests (marker `container`: the Docker daemon, minutes of image
    building) only when asked for, by `-m container` (.ci/run's stage after the suite). The interpreted kernel checks'
    test last: their processes (started below) run on the CPU time the other tests leave idle, and the later their
    results are collected, the more of that time they have had."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    if "container" not in (config.option.markexpr or ""):
        asked = [i for i in items if i.get_closest_marker("container") is None]
        if len(asked) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("container")])
            items[:] = asked
    if len(items) >= 20:
        items.sort(key=lambda i: i.nodeid.endswith("test_kernels_match_pytorch_under_interpreter"))  # stable


def _whole_suite(config) -> bool:
    """Whether this run is the whole suite (folders only; no -k, -m, --deselect of the kernel checks, --collect-only)."""
    o = config.option
    return (not o.keyword and not o.markexpr and not o.collectonly
            and not any("test_kernels" in d for d in (getattr(o, "deselect", None) or []))
            and all(Path(a).is_dir() for a in config.args))


def pytest_sessionstart(session):
    """Under pytest-xdist (`-n`), in its controller: for the whole suite, start the interpreted kernel checks niced
    (tests/kernel_checks.py) before the workers start, and name their folder to the workers (which inherit this
    environment); the worker that runs their test collects the results."""
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput") and _whole_suite(config):
        from kernel_checks import BACKGROUND, ENV, Checks

        checks = config.stash[BACKGROUND] = Checks.start(nice=19)
        os.environ[ENV] = str(checks.folder)


def pytest_collection_finish(session):
    """Without pytest-xdist, with the interpreted kernel checks among other tests: start them now, niced
    (tests/kernel_checks.py), on a checkpoint of their own; their test collects the results."""
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller started them (or the test will)
        return
    kernels = [i for i in session.items if i.nodeid.endswith("test_kernels_match_pytorch_under_interpreter")]
    if not kernels or len(session.items) < 20 or session.config.option.collectonly:
        return
    from kernel_checks import BACKGROUND, Checks

    session.config.stash[BACKGROUND] = Checks.start(nice=19)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """The run must end when its tests do. A non-daemon thread still running (the interpreter joins
    it at exit) or a child process still alive hangs CI after the summary, so either fails the run,
    with the thread's stack or the process's command line. A backstop: if the exit itself hangs,
    faulthandler prints every thread's stack and ends the process after 5 minutes."""
    from kernel_checks import BACKGROUND

    checks = session.config.stash.get(BACKGROUND, None)
    if checks is not None:  # killed if still running (their test did not run: -x, -k, interrupted); folder removed
        checks.stop()
    leaks = []
    frames = sys._current_frames()
    for t in threading.enumerate():
        if t is threading.main_thread() or t.daemon or not t.is_alive():
            continue
        stack = "".join(traceback.format_stack(frames[t.ident])) if t.ident in frames else "?"
        leaks.append(f"non-daemon thread {t.name!r} still running:\n{stack}")
    for pid, cmd in _live_children():
        leaks.append(f"child process {pid} still running: {cmd}")
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if leaks:
        sys.stderr.write("\n".join(["", "test run left work behind (it would hang the exit):", *leaks, ""]))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    faulthandler.dump_traceback_later(300, exit=True)
