"""OpenAI-compatible HTTP gateway in front of Triton's gRPC stream to the `s2pro` model.

`python -m s2tts.gateway --triton-url localhost:8001 --port 8080 --db voices.sqlite3`; see docs/GATEWAY.md.
"""

from .options import GatewayConfig

__all__ = ["GatewayConfig", "create_app"]


def create_app(cfg: GatewayConfig | None = None, **kwargs):
    from .app import create_app as _create  # noqa: PLC0415 - keeps `import s2tts.gateway` light

    return _create(cfg or GatewayConfig(), **kwargs)
