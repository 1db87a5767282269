"""The container image (docker/Dockerfile) on the real Docker daemon, from this checkout: a Debian base made from
Debian's packages (docker/make_base.sh; kept when the daemon has it), the Python packages from a wheelhouse made
once per run (scripts/make_wheelhouse.py, CPU torch), tritonserver from the nvidia-pytriton wheel; run with the
tiny checkpoint and asked through tritonclient (gRPC), the openai SDK and the fish-audio-sdk; stopped with a request
in flight; and the compose stack (docker/compose.yaml) with Prometheus scraping the speech metrics.

Those tests are marked `container` and run only when asked (`bash scripts/test.sh -m container`: .ci/run's last
stage; they need root, debootstrap, docker-compose and a running dockerd). The image's size and build time are
reported on the terminal. The unmarked tests check the compose files and the entrypoint without a daemon.
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
import yaml

from s2tts.launch import wait_http
from servers import free_port

ROOT = Path(__file__).resolve().parents[1]
DOCKER_DIR = ROOT / "docker"
sys.path.insert(0, str(DOCKER_DIR))
import entrypoint  # noqa: E402  (docker/entrypoint.py)

container = pytest.mark.container
BASE = "s2tts-debian:bookworm"  # docker/make_base.sh's default
IMAGE, PROMETHEUS_IMAGE = "s2tts:test", "s2tts-prometheus:test"
NAME = f"s2tts-test-{os.getpid()}"
KEY = "container-key"
STOP_GRACE_S = 60  # `docker stop -t`: SIGKILL (exit code 137) after this long


def _run(cmd: list[str], timeout: float = 120, check: bool = True, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode:
        raise AssertionError(f"{' '.join(cmd)} exited with {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["docker", *args], timeout, check)


def compose_command() -> list[str] | None:
    """`docker compose` (the plugin) where it exists, else `docker-compose` (Debian bookworm has v1.29)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def report(config, line: str) -> None:
    tr, capture = config.pluginmanager.get_plugin("terminalreporter"), config.pluginmanager.get_plugin("capturemanager")
    if tr is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            tr.write_line(f"[container] {line}")


@pytest.fixture(scope="module")
def daemon():
    missing = [c for c in ("docker", "debootstrap") if not shutil.which(c)]
    reachable = not missing and subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0
    if missing or not reachable:
        why = f"needs {' and '.join(missing)}" if missing else "needs a running Docker daemon (dockerd)"
        if os.environ.get("CI"):
            pytest.fail(f"the container stage {why} (.ci/run installs docker.io and debootstrap and starts dockerd)")
        pytest.skip(f"{why}: apt-get install docker.io debootstrap docker-compose, then start dockerd")


@pytest.fixture(scope="module")
def image(daemon, request):
    """The image built from this checkout on the Debian base, with a wheelhouse made now."""
    t0 = time.monotonic()
    had_base = docker("image", "inspect", BASE, check=False).returncode == 0
    _run(["bash", str(DOCKER_DIR / "make_base.sh"), BASE], timeout=600)
    t1 = time.monotonic()
    # CPU torch: the wheel setup.sh installs
    _run([sys.executable, str(ROOT / "scripts" / "make_wheelhouse.py"), "--cpu", "--torch", "torch==2.13.0"],
         timeout=600)
    t2 = time.monotonic()
    _run(["bash", str(DOCKER_DIR / "build.sh"), "--base", BASE, "--tag", IMAGE], timeout=900)
    t3 = time.monotonic()
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout)
    report(request.config, f"base {BASE}: {'reused' if had_base else f'made in {t1 - t0:.0f} s'}; wheelhouse "
                           f"{t2 - t1:.0f} s; image {IMAGE} built in {t3 - t2:.0f} s, {size / 1e9:.2f} GB")
    return IMAGE


@pytest.fixture(scope="module")
def prometheus_image(image, request):
    t0 = time.monotonic()
    with open(DOCKER_DIR / "prometheus.Dockerfile", "rb") as f:
        p = subprocess.run(["docker", "build", "-q", "-t", PROMETHEUS_IMAGE, "--build-arg", f"BASE={BASE}", "-"],
                           stdin=f, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    size = int(docker("image", "inspect", "-f", "{{.Size}}", PROMETHEUS_IMAGE).stdout)
    report(request.config, f"{PROMETHEUS_IMAGE} built in {time.monotonic() - t0:.0f} s, {size / 1e6:.0f} MB")
    return PROMETHEUS_IMAGE


@pytest.fixture(scope="module")
def checkpoint(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint, readable by the container's user (the safetensors files are written 0600)."""
    out = tmp_path_factory.mktemp("container_ckpt") / "tiny"
    shutil.copytree(tiny_ckpt, out)
    _run(["chmod", "-R", "a+rX", str(out.parent)])
    return out


def _logs(name: str) -> str:
    out = docker("logs", "--tail", "60", name, check=False)
    tail = docker("exec", name, "sh", "-c", "tail -n 40 /tmp/s2tts/triton/tritonserver.log /tmp/s2tts/gateway.log",
                  check=False)
    return f"{out.stdout}{out.stderr}\n{tail.stdout}"


def _wait_healthy(name: str, timeout: float = 300) -> None:
    """Until the image's HEALTHCHECK (the gateway's /health: s2pro ready behind it) says healthy."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = docker("inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", name).stdout.split()
        if state[0] != "running":
            raise AssertionError(f"{name} is {state[0]}:\n{_logs(name)}")
        if state[1:] == ["healthy"]:
            return
        time.sleep(1)
    raise AssertionError(f"{name} not healthy after {timeout:.0f} s:\n{_logs(name)}")


def _port(name: str, port: int) -> str:
    return docker("port", name, str(port)).stdout.split()[0]


@pytest.fixture(scope="module")
def served(image, checkpoint):
    """The image's default start (tritonserver + gateway) with settings from the environment and from arguments:
    dtype from S2TTS_DTYPE, max_new_tokens_limit both ways (the argument wins), the API key from S2TTS_API_KEY."""
    docker("run", "-d", "--name", NAME, "--shm-size=512m", "-e", "OMP_NUM_THREADS=1", "-e", "S2TTS_DTYPE=fp32",
           "-e", "S2TTS_MAX_NEW_TOKENS_LIMIT=9", "-e", f"S2TTS_API_KEY={KEY}",
           "-v", f"{checkpoint}:/models/s2-pro:ro", "-p", "127.0.0.1::8001", "-p", "127.0.0.1::8080",
           image, "--set", "max_new_tokens_limit=500", "--set", "max_concurrent_requests=8")
    try:
        _wait_healthy(NAME)
        yield {"grpc": _port(NAME, 8001), "http": f"http://{_port(NAME, 8080)}"}
    finally:
        docker("rm", "-f", "-v", NAME, check=False)


def _final(result) -> bool:
    p = result.get_response().parameters.get("triton_final_response")
    return bool(p and p.bool_param)


def _ends_request(result, error) -> bool:
    """A final response, or an error response of s2pro's (tagged: it ends the request); not a broken connection."""
    from s2tts import errors

    return _final(result) if error is None else errors.is_tagged(error.message())


def _stream(url: str, req, rid: str, while_streaming=None, timeout: float = 120) -> list:
    """Every (result, error) of one s2pro request streamed with tritonclient, up to its end; `while_streaming` is
    called once, after the first audio. The stream is then half-closed and what else arrives is kept too."""
    import tritonclient.grpc as g

    q: queue.Queue = queue.Queue()
    client = g.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    events, called = [], False
    try:
        client.async_stream_infer("s2pro", req.to_inputs(), request_id=rid, enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=timeout)
            events.append((result, error))
            if error is not None or _final(result):
                break
            audio = result.as_numpy("audio")
            if while_streaming and not called and audio is not None and audio.size:
                called = True
                while_streaming()
    finally:
        client.stop_stream()  # half-close: returns when the server has ended the call
        client.close()
    while not q.empty():
        events.append(q.get())
    return events


def _audio(events) -> np.ndarray:
    parts = [r.as_numpy("audio").reshape(-1) for r, e in events if e is None and r.as_numpy("audio") is not None]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def _check_wav(data: bytes) -> None:
    audio, sr = sf.read(io.BytesIO(data), dtype="float32")
    assert sr == 44100 and audio.ndim == 1 and len(audio) > 0 and len(audio) % 2048 == 0
    assert np.abs(audio).max() > 1e-4


def _speech_via_openai(base: str, text: str) -> bytes:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    return client.audio.speech.create(model="s2-pro", voice="default", input=text, response_format="wav",
                                      extra_body={"seed": 1, "max_new_tokens": 30}).content


def _run_to_exit(image: str, *args: str, timeout: float = 120) -> tuple[int, str]:
    """(exit code, output) of a container of `image` with `args` (docker run's, then the image's), removed after."""
    name = f"{NAME}-once"
    docker("run", "-d", "--name", name, *args, timeout=60)
    try:
        code = docker("wait", name, timeout=timeout).stdout.strip()
        logs = docker("logs", name)
        return int(code), logs.stdout + logs.stderr
    finally:
        docker("rm", "-f", "-v", name, check=False)


@container
def test_too_little_shared_memory_is_refused_before_the_server_starts(image, checkpoint):
    code, out = _run_to_exit(image, "--shm-size=16m", "-v", f"{checkpoint}:/models/s2-pro:ro", image)
    assert code == 1, out
    assert "--shm-size=" in out and "/dev/shm has 16 MiB free" in out, out
    assert "tritonserver ready" not in out


@container
def test_a_checkpoint_the_user_cannot_read_is_refused(image, tiny_ckpt):
    code, out = _run_to_exit(image, "-v", f"{tiny_ckpt}:/models/s2-pro:ro", image)
    assert code == 1 and "not readable by uid 1000" in out and ".safetensors" in out, out


@container
def test_sigterm_while_the_models_load_exits_0(image, checkpoint):
    """`docker stop` before the server is ready (the models load for minutes on a GPU): the start is abandoned and
    the container exits 0, with no SIGKILL (docker stop's after its grace: exit code 137)."""
    name = f"{NAME}-early"
    docker("run", "-d", "--name", name, "-e", "OMP_NUM_THREADS=1", "-v", f"{checkpoint}:/models/s2-pro:ro", image)
    try:
        deadline, top = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "tritonserver" not in top:
            top = docker("top", name, "-eo", "pid,args", check=False).stdout
            time.sleep(0.1)
        assert "tritonserver" in top and "s2tts.gateway" not in top, top  # loading: the gateway starts once it is ready
        docker("stop", "-t", "30", name, timeout=90)
        assert docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip() == "0", _logs(name)
    finally:
        docker("rm", "-f", "-v", name, check=False)


@container
def test_every_process_runs_as_the_unprivileged_user(served):
    assert docker("exec", NAME, "id", "-u").stdout.strip() == "1000"
    top = docker("top", NAME, "-eo", "pid,uid,args").stdout.splitlines()[1:]
    assert any("tritonserver" in line for line in top) and any("s2tts.gateway" in line for line in top), top
    assert all(line.split()[1] == "1000" for line in top), top


@container
def test_grpc_stream_from_tritonclient_answers_with_audio(served):
    from s2tts.client import TTSInput

    events = _stream(served["grpc"], TTSInput(text="Hello from the container.", seed=1, max_new_tokens=40), "grpc-1")
    assert all(e is None for _, e in events), [str(e) for _, e in events if e is not None]
    assert sum(_final(r) for r, _ in events) == 1
    audio = _audio(events)
    assert len(audio) > 0 and len(audio) % 2048 == 0 and np.abs(audio).max() > 1e-4


@container
def test_openai_speech_through_the_gateway(served):
    _check_wav(_speech_via_openai(served["http"], "The OpenAI route, in a container."))
    # the key came from S2TTS_API_KEY: without it, refused
    r = httpx.post(f"{served['http']}/v1/audio/speech", json={"model": "s2-pro", "input": "x", "voice": "default"})
    assert r.status_code == 401


@container
def test_fish_tts_through_the_gateway(served):
    from fishaudio import FishAudio
    from fishaudio.types import TTSConfig

    sdk = FishAudio(api_key=KEY, base_url=served["http"])
    # greedy: the tiny model's first frame is then never its end token (tests/test_fish_api.py)
    _check_wav(sdk.tts.convert(text="Fish, in a container.", format="wav",
                               config=TTSConfig(max_new_tokens=12, temperature=0.0)))


@container
def test_settings_from_the_environment_and_from_arguments(served):
    import tritonclient.grpc as g

    with g.InferenceServerClient(served["grpc"]) as client:
        params = client.get_model_config("s2pro", as_json=True)["config"]["parameters"]
    assert params["dtype"]["string_value"] == "fp32"  # S2TTS_DTYPE
    # max_new_tokens_limit: 9 in the environment, 500 as an argument: the argument's
    assert params["max_new_tokens_limit"]["string_value"] == "500"
    r = httpx.post(f"{served['http']}/v1/audio/speech", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "s2-pro", "input": "x", "voice": "default", "max_new_tokens": 501})
    assert r.status_code == 400 and "500" in r.text, r.text


@container
def test_sigterm_with_a_request_in_flight_ends_it_once_and_exits_0(served, request):
    """`docker stop` while a long request streams: the request gets exactly one final response (here an error, the
    models going away) and the container exits 0 within STOP_GRACE_S (docker stop kills it then: exit code 137)."""
    from s2tts.client import TTSInput

    stop = {}

    def send_sigterm():
        stop["t"] = time.monotonic()
        stop["proc"] = subprocess.Popen(["docker", "stop", "-t", str(STOP_GRACE_S), NAME], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT)

    req = TTSInput(text="A long request that the stop interrupts.", seed=3, max_new_tokens=500, ignore_eos=True,
                   first_chunk_frames=2, chunk_frames=2)
    events = _stream(served["grpc"], req, "stopped-1", while_streaming=send_sigterm)
    assert "proc" in stop, "the request ended before its first audio"
    stop["proc"].wait(STOP_GRACE_S + 30)
    took = time.monotonic() - stop["t"]
    ends = [i for i, (r, e) in enumerate(events) if _ends_request(r, e)]
    assert len(ends) == 1, [(None if e is None else e.message()) for _, e in events]
    end = events[ends[0]][1]
    if end is not None:  # the models going away: retry on another server, not a fault of the request
        from s2tts import errors

        assert errors.parse(end.message()).code == "unavailable", end.message()
    chunks = sum(1 for r, e in events[:ends[0]] if e is None and r.as_numpy("audio") is not None)
    assert chunks < 250, "the request was not in flight at the stop"  # 500 frames, 2 a chunk
    assert not any(e is None and r.as_numpy("audio") is not None for r, e in events[ends[0] + 1:])
    state = docker("inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", NAME).stdout.split()
    assert state == ["exited", "0"], f"{state}\n{_logs(NAME)}"
    report(request.config, f"docker stop with a request in flight: exited 0 after {took:.1f} s")


@container
def test_compose_stack_answers_and_prometheus_scrapes_the_speech_metrics(image, prometheus_image, checkpoint,
                                                                          tmp_path, request):
    compose = compose_command()
    if compose is None:
        pytest.fail("needs docker compose or docker-compose (Debian's docker-compose package)")
    # the CPU here: one compute thread per process (as the test suite's servers), fp32 (as theirs)
    override = tmp_path / "cpu.yaml"
    override.write_text(yaml.safe_dump({"services": {"tritonserver": {
        "environment": {"OMP_NUM_THREADS": "1", "S2TTS_DTYPE": "fp32"}}}}))
    gw_port, grpc_port, prom_port = free_port(), free_port(), free_port()
    env = {**os.environ, "S2TTS_IMAGE": image, "PROMETHEUS_IMAGE": prometheus_image,
           "S2TTS_CHECKPOINT_DIR": str(checkpoint), "S2TTS_PORT": str(gw_port), "S2TTS_GRPC_PORT": str(grpc_port),
           "PROMETHEUS_PORT": str(prom_port)}
    cmd = [*compose, "-p", f"s2ttstest{os.getpid()}", "-f", str(DOCKER_DIR / "compose.yaml"), "-f", str(override)]
    t0 = time.monotonic()
    try:
        _run([*cmd, "up", "-d"], timeout=600, env=env)  # the gateway starts once tritonserver is healthy
        base, prom = f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{prom_port}"
        wait_http(f"{base}/health", 120)
        report(request.config, f"compose stack up and healthy in {time.monotonic() - t0:.0f} s")
        _check_wav(_speech_via_openai(base, "The OpenAI route, in the compose stack."))

        def query(expr: str) -> list:
            body = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
            assert body["status"] == "success", body
            return body["data"]["result"]

        audio = 'sum(s2tts_audio_seconds_total{model="s2pro"})'
        served_ok = 'sum(s2tts_gateway_requests_total{route="/v1/audio/speech",status="200"})'
        deadline, got = time.monotonic() + 90, {}
        while time.monotonic() < deadline:
            try:
                got = {e: query(e) for e in (audio, served_ok, "up")}
            except httpx.HTTPError:
                got = {}
            if got and got[audio] and float(got[audio][0]["value"][1]) > 0 and got[served_ok] \
                    and float(got[served_ok][0]["value"][1]) >= 1:
                break
            time.sleep(1)
        assert got and got[audio] and float(got[audio][0]["value"][1]) > 0, got
        assert float(got[served_ok][0]["value"][1]) >= 1, got
        assert {s["metric"]["job"] for s in got["up"]} == {"triton", "gateway"}
        assert all(s["value"][1] == "1" for s in got["up"]), got["up"]
    except BaseException:
        logs = _run([*cmd, "logs", "--tail", "40"], timeout=60, check=False, env=env)
        print(logs.stdout[-6000:], logs.stderr[-2000:])
        raise
    finally:
        _run([*cmd, "down", "-v", "--remove-orphans", "-t", "30"], timeout=180, check=False, env=env)


# Without a daemon: the compose files agree with the code they start, and the entrypoint's command lines parse.

def _compose() -> dict:
    return yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())


def test_compose_files_agree_with_the_servers_they_start():
    from s2tts.gateway.__main__ import build_parser as gateway_parser
    from s2tts.server import build_parser as server_parser

    services = _compose()["services"]
    assert set(services) == {"tritonserver", "gateway", "prometheus", "grafana"}
    triton_cmd = entrypoint.command(services["tritonserver"]["command"], {})
    gateway_cmd = entrypoint.command(services["gateway"]["command"], {})
    assert triton_cmd[0] == "s2tts.server" and gateway_cmd[0] == "s2tts.gateway"
    targs, gargs = server_parser().parse_args(triton_cmd[1:]), gateway_parser().parse_args(gateway_cmd[1:])
    assert targs.checkpoint == entrypoint.CHECKPOINT and targs.address == "0.0.0.0"
    assert gargs.triton_url == f"tritonserver:{targs.grpc_port}" and gargs.host == "0.0.0.0"
    assert services["tritonserver"]["healthcheck"]["test"][-1] == f"http://127.0.0.1:{targs.http_port}/v2/health/ready"
    assert any(p.endswith(f":{targs.grpc_port}") for p in services["tritonserver"]["ports"])
    assert any(p.endswith(f":{gargs.port}") for p in services["gateway"]["ports"])
    # Prometheus scrapes tritonserver's metrics port and the gateway's /metrics, by service name
    prom = yaml.safe_load((DOCKER_DIR / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in prom["scrape_configs"]}
    assert targets == {"triton": [f"tritonserver:{targs.metrics_port}"], "gateway": [f"gateway:{gargs.port}"]}
    # Grafana: the dashboard's Prometheus data source is this Prometheus, and the dashboard is mounted where its
    # provider reads
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    source, dashboards = mounts["./grafana/provisioning"], mounts["../deploy/grafana"]
    assert source == "/etc/grafana/provisioning" and (ROOT / "deploy" / "grafana" / "s2tts.json").is_file()
    ds = yaml.safe_load((DOCKER_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus" and ds["datasources"][0]["url"] == "http://prometheus:9090"
    assert any(p.endswith(":9090") for p in services["prometheus"]["ports"])
    dash = json.loads((ROOT / "deploy" / "grafana" / "s2tts.json").read_text())
    assert {"name": "datasource", "type": "datasource"}.items() <= dash["templating"]["list"][0].items()
    provider = yaml.safe_load((DOCKER_DIR / "grafana" / "provisioning" / "dashboards" / "s2tts.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == dashboards


def test_entrypoint_takes_settings_from_the_environment_and_arguments_win():
    from s2tts.server import parse_settings

    cmd = entrypoint.command(["--set", "max_batch=4"], {"S2TTS_MAX_BATCH": "16", "S2TTS_DTYPE": "fp32",
                                                        "S2TTS_CHECKPOINT": "/ckpt", "S2TTS_NOT_A_SETTING": "1"})
    assert cmd[0] == "s2tts.launch" and entrypoint.last_value(cmd, "--checkpoint") == "/ckpt"
    sets = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--set"]
    assert parse_settings(sets) == {"max_batch": "4", "dtype": "fp32"}
    assert entrypoint.command(["gateway"], {"S2TTS_VOICE_DB": "postgresql://db/voices"})[:3] == \
        ["s2tts.gateway", "--host", "0.0.0.0"] and "--db" not in entrypoint.command(["gateway"], {"S2TTS_VOICE_DB": "x"})


def test_entrypoint_says_what_to_mount_when_there_is_no_checkpoint(tmp_path):
    assert "mount one there" in entrypoint.checkpoint_problem(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert entrypoint.checkpoint_problem(tmp_path) is None


def test_shared_memory_check_warns_below_what_the_load_can_take(tmp_path):
    """The /dev/shm check on a folder here (its free space is what `os.statvfs` says): the defaults' need fits, and
    more concurrent requests than its space can hold give the warning that names --shm-size (the refusal is the
    container test's: a --shm-size=16m container)."""
    from s2tts.server import check_shared_memory, shared_memory_need

    start, load = shared_memory_need({}, 5)
    assert 0 < start < load
    assert check_shared_memory({}, 5, tmp_path) is None
    warning = check_shared_memory({"max_concurrent_requests": "100000"}, 5, tmp_path)
    assert warning is not None and "--shm-size=" in warning and "max_concurrent_requests=100000" in warning
