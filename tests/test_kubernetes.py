"""The Kubernetes manifests (`deploy/kubernetes/`): valid against the Kubernetes API schemas (kubernetes-validate,
strict: no unknown fields) for the oldest and newest versions it carries, and consistent with the code: the
commands parse with the real argument parsers, settings are real settings, ports and probe paths are the ones the
running tritonserver and gateway serve, the autoscaler's metric is one the models export. Not run on a cluster."""

from pathlib import Path

import httpx
import pytest
import yaml

from s2tts import settings as S
from s2tts.gateway.__main__ import build_parser as gateway_parser
from s2tts.server import build_parser as server_parser
from s2tts.server import parse_settings
from s2tts.serving.metrics import METRICS

from servers import Gateway

kv = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))


def _docs():
    return [(f.name, d) for f in FILES for d in yaml.safe_load_all(f.read_text()) if d]


def _by_kind(kind):
    return {d["metadata"]["name"]: d for _, d in _docs() if d["kind"] == kind}


def _versions():
    import kubernetes_validate.utils as u

    vs = sorted(set(u.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return [vs[0], vs[-1]]


@pytest.mark.parametrize("version", _versions())
def test_manifests_validate_against_the_kubernetes_schemas(version):
    assert {f.name for f in FILES} >= {"storage.yaml", "tritonserver.yaml", "gateway.yaml", "autoscaling.yaml",
                                       "prometheus-adapter.yaml"}
    for name, doc in _docs():
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: {e.message}")


def test_manifests_match_the_code(triton_server, tmp_path):
    deploy = _by_kind("Deployment")
    services = _by_kind("Service")
    triton = deploy["s2tts-triton"]["spec"]["template"]["spec"]["containers"][0]
    gw = deploy["s2tts-gateway"]["spec"]["template"]["spec"]["containers"][0]

    # the commands parse with the real command lines, and every --set is a real setting
    assert triton["command"][-1] == "s2tts.server" and gw["command"][-1] == "s2tts.gateway"
    targs = server_parser().parse_args(triton["args"])
    assert set(parse_settings(targs.set)) <= set(S.SCHEMA) and targs.address == "0.0.0.0"
    gargs = gateway_parser().parse_args(gw["args"])

    # ports: the server's, the container's, the Service's
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert ports == {"http": targs.http_port, "grpc": targs.grpc_port, "metrics": targs.metrics_port}
    assert {p["name"]: p["port"] for p in services["s2tts-triton"]["spec"]["ports"]} == ports
    host, port = gargs.triton_url.rsplit(":", 1)
    assert host == "s2tts-triton" and int(port) == ports["grpc"]  # the gateway reaches Triton's gRPC Service
    assert {p["name"]: p["containerPort"] for p in gw["ports"]} == {"http": gargs.port}
    ann = deploy["s2tts-triton"]["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == ports["metrics"]

    # the probes ask paths the running servers answer
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = triton[probe]["httpGet"]
        assert get["port"] == "http"
        assert httpx.get(f"{triton_server.http_url}{get['path']}", timeout=10).status_code == 200, (probe, get)
    g = Gateway(triton_server.grpc_url, tmp_path / "voices.sqlite3", tmp_path / "gateway.log")
    try:
        for probe in ("readinessProbe", "livenessProbe"):
            assert httpx.get(f"{g.url}{gw[probe]['httpGet']['path']}", timeout=10).status_code == 200, probe
        assert httpx.get(f"{g.url}{deploy['s2tts-gateway']['spec']['template']['metadata']['annotations']['prometheus.io/path']}",
                         timeout=10).status_code == 200
    finally:
        g.stop()

    # volumes and the GPU
    mounts = {m["name"]: m["mountPath"] for m in triton["volumeMounts"]}
    assert mounts["checkpoint"] == targs.checkpoint and triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {m["mountPath"] for m in gw["volumeMounts"]} == {str(Path(gargs.db).parent)}
    # the GPU kernels compiled on first use outlive the pod on its node (a restart skips compiling), at the path the
    # image sets too
    cache = {e["name"]: e["value"] for e in triton["env"]}["TRITON_CACHE_DIR"]
    vol = next(n for n, path in mounts.items() if cache.startswith(path + "/"))
    spec = {v["name"]: v for v in deploy["s2tts-triton"]["spec"]["template"]["spec"]["volumes"]}[vol]
    assert "hostPath" in spec, spec
    assert f"ENV TRITON_CACHE_DIR={cache}" in (ROOT / "docker" / "Dockerfile").read_text()

    # the autoscaler scales the Triton Deployment on a metric the models export, which the adapter's rule exposes
    hpa = _by_kind("HorizontalPodAutoscaler")["s2tts-triton"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "s2tts-triton"
    metric = hpa["metrics"][0]["pods"]["metric"]["name"]
    assert metric in METRICS
    rules = yaml.safe_load(_by_kind("ConfigMap")["s2tts-prometheus-adapter-rules"]["data"]["config.yaml"])["rules"]
    assert any(metric in r["seriesQuery"] and r["name"]["as"] == metric for r in rules)
    assert float(hpa["metrics"][0]["pods"]["target"]["averageValue"]) < S.SCHEMA["max_concurrent_requests"].default
