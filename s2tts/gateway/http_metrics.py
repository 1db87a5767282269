"""The gateway's own Prometheus metrics (`GET /metrics`, text exposition format 0.0.4).

- `s2tts_gateway_requests_total{route, method, status}`: every HTTP request, when its answer ends;
- `s2tts_gateway_request_seconds{route}`: a histogram of the time from the request to the answer's last byte
  (for a streamed speech answer: the whole stream);
- `s2tts_gateway_speech_in_flight`: speech requests being served now;
- `s2tts_gateway_overload_refusals_total`: speech requests refused with 503 because `--max-in-flight` were busy.

Routes are the templates (`/v1/audio/voices/{name}`), never raw paths, so the label set stays small.
The speech models' own metrics (time to first audio, frames, KV use, ...) are on Triton's metrics port.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_ROUTES = [
    (re.compile(r"^/v1/audio/voices/[^/]+/audio$"), "/v1/audio/voices/{name}/audio"),
    (re.compile(r"^/v1/audio/voices/[^/]+$"), "/v1/audio/voices/{name}"),
    (re.compile(r"^/v1/models/[^/]+$"), "/v1/models/{id}"),
    (re.compile(r"^/model/[^/]+$"), "/model/{id}"),
]
_FIXED = {"/", "/health", "/metrics", "/v1/audio/speech", "/v1/audio/voices", "/v1/models", "/v1/tts", "/model",
          "/v1/health", "/v1/references/add", "/v1/references/list", "/v1/references/delete", "/v1/references/update",
          "/v1/vqgan/encode", "/v1/vqgan/decode"}


def route_of(path: str) -> str:
    path = path.rstrip("/") or "/"
    if path in _FIXED:
        return path
    for pattern, name in _ROUTES:
        if pattern.match(path):
            return name
    return "other"


class HTTPMetrics:
    def __init__(self):
        self.requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self.latency: dict[str, list[int]] = {}  # route -> counts per bucket (+Inf last)
        self.latency_sum: dict[str, float] = defaultdict(float)
        self.overload_refusals = 0
        self.in_flight = lambda: 0  # set by the app: the speech limiter's count

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests[(route, method, str(status))] += 1
        counts = self.latency.setdefault(route, [0] * (len(BUCKETS) + 1))
        for i, le in enumerate(BUCKETS):
            if seconds <= le:
                counts[i] += 1
        counts[-1] += 1
        self.latency_sum[route] += seconds

    def render(self) -> str:
        out = ["# HELP s2tts_gateway_requests_total HTTP requests answered, by route template, method and status",
               "# TYPE s2tts_gateway_requests_total counter"]
        for (route, method, status), n in sorted(self.requests.items()):
            out.append(f's2tts_gateway_requests_total{{route="{route}",method="{method}",status="{status}"}} {n}')
        out += ["# HELP s2tts_gateway_request_seconds time from the request to the last byte of its answer",
                "# TYPE s2tts_gateway_request_seconds histogram"]
        for route, counts in sorted(self.latency.items()):
            for le, n in zip([*map(str, BUCKETS), "+Inf"], counts):
                out.append(f's2tts_gateway_request_seconds_bucket{{route="{route}",le="{le}"}} {n}')
            out.append(f's2tts_gateway_request_seconds_sum{{route="{route}"}} {self.latency_sum[route]:.6f}')
            out.append(f's2tts_gateway_request_seconds_count{{route="{route}"}} {counts[-1]}')
        out += ["# HELP s2tts_gateway_speech_in_flight speech requests being served",
                "# TYPE s2tts_gateway_speech_in_flight gauge",
                f"s2tts_gateway_speech_in_flight {self.in_flight()}",
                "# HELP s2tts_gateway_overload_refusals_total speech requests refused with 503 (max in flight)",
                "# TYPE s2tts_gateway_overload_refusals_total counter",
                f"s2tts_gateway_overload_refusals_total {self.overload_refusals}"]
        return "\n".join(out) + "\n"


class MetricsMiddleware:
    """Outermost ASGI layer: counts every answer (refusals by the guard included) when its last byte is sent, or
    when the client goes away first (status as sent, or 499 if nothing was)."""

    def __init__(self, app, metrics: HTTPMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        state = {"status": 499, "done": False}

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                state["status"] = msg["status"]
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False) and not state["done"]:
                state["done"] = True
                self.metrics.observe(route_of(scope["path"]), scope["method"], state["status"], time.monotonic() - t0)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            if not state["done"]:
                state["done"] = True
                self.metrics.observe(route_of(scope["path"]), scope["method"], state["status"], time.monotonic() - t0)
