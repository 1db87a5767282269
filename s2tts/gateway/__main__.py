"""`python -m s2tts.gateway --triton-url localhost:8001 --host 127.0.0.1 --port 8080 --db PATH [--api-key K] [--max-in-flight N]`"""

from __future__ import annotations

import argparse
import logging
import os

from .options import GatewayConfig


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list; 'off' or '' is none."""
    return () if value.strip().lower() in ("", "off", "none") else tuple(v.strip() for v in value.split(",") if v.strip())


def _off(value: str) -> str | None:
    return None if value.strip().lower() == "off" else value.strip()


def build_parser() -> argparse.ArgumentParser:
    d = GatewayConfig()
    ap = argparse.ArgumentParser(prog="python -m s2tts.gateway", description=__doc__.strip("`"))
    ap.add_argument("--triton-url", default=d.triton_url, help="Triton gRPC address host:port (default %(default)s)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080, help="(default %(default)s; tritonserver's HTTP port is 8000)")
    ap.add_argument("--db", default=os.environ.get("S2TTS_VOICE_DB", d.db_path),
                    help="where registered voices live: an SQLite file (default %(default)s), or a postgresql:// URL "
                         "shared by gateway replicas (env S2TTS_VOICE_DB; keep passwords out of command lines)")
    ap.add_argument("--api-key", default=os.environ.get("S2TTS_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every endpoint but /health, /metrics and the page / (default: env S2TTS_API_KEY)")
    ap.add_argument("--max-in-flight", type=int, default=d.max_in_flight,
                    help="speech requests served at once; more get 503 + Retry-After (default: s2pro's "
                         "max_concurrent_requests, read from the server)")
    ap.add_argument("--triton-timeout", type=float, default=None,
                    help="longest silence in seconds between two responses of a speech stream (default: s2pro's "
                         "request_timeout_s + 30, read from the server)")
    ap.add_argument("--retry-after", type=int, default=d.retry_after_s, help="Retry-After seconds on 503 overload")
    ap.add_argument("--served-model-name", default=d.served_model_name, help="model id in /v1/models")
    ap.add_argument("--openai-models", type=_names, default=",".join(d.openai_models),
                    help="OpenAI's model names served as aliases of the model, comma-separated, or 'off' (default "
                         "%(default)s)")
    ap.add_argument("--fish-models", type=_names, default=",".join(d.fish_models),
                    help="Fish Audio's model names (its `model` header) served as aliases on its routes, "
                         "comma-separated, or 'off' (default %(default)s)")
    ap.add_argument("--openai-voice", type=_off, default=d.openai_voice,
                    help="what OpenAI's voice names (alloy, nova, ...) speak with unless a voice of that name is "
                         "registered: 'default' (no reference voice; the default), a registered voice's name, or 'off' "
                         "(they are unknown names: 404)")
    ap.add_argument("--triton-model", default=d.triton_model)
    ap.add_argument("--encoder-model", default=d.encoder_model)
    ap.add_argument("--decoder-model", default=d.decoder_model)
    ap.add_argument("--max-input-chars", type=int, default=None,
                    help="longest input accepted (default: s2pro's max_text_chars, read from the server)")
    ap.add_argument("--max-new-tokens-limit", type=int, default=None,
                    help="largest max_new_tokens accepted (default: s2pro's max_new_tokens_limit)")
    ap.add_argument("--max-upload-mb", type=float, default=d.max_upload_bytes / 2**20,
                    help="largest voice upload / inline reference file in MiB (default %(default)s)")
    ap.add_argument("--max-reference-seconds", type=float, default=None,
                    help="longest reference clip (default: s2pro's max_reference_seconds)")
    ap.add_argument("--max-decode-frames", type=int, default=d.max_decode_frames,
                    help="most frames one /v1/vqgan/decode call decodes (default %(default)s, ~4.6 min of S2 Pro audio)")
    ap.add_argument("--ref-audio-hosts", type=_names, default=",".join(d.ref_audio_hosts),
                    help="ref_audio http(s) URLs are fetched only from these, comma-separated: host names (with a port "
                         "or not), IP addresses or networks, URL prefixes; private and loopback addresses only when an "
                         "address or network here holds them (default: none, URLs are refused)")
    ap.add_argument("--ref-audio-dir", default=d.ref_audio_dir,
                    help="ref_audio file:// paths are read only under this directory (default: none, refused)")
    ap.add_argument("--ref-audio-timeout", type=float, default=d.ref_audio_timeout_s,
                    help="seconds a ref_audio URL may take, redirects and body (default %(default)s)")
    ap.add_argument("--live-idle-timeout", type=float, default=d.live_idle_timeout_s,
                    help="close a live WebSocket that has no session for this many seconds (default %(default)s)")
    ap.add_argument("--log-level", default="info")
    return ap


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn  # noqa: PLC0415

    from .app import create_app  # noqa: PLC0415

    try:
        cfg = GatewayConfig(
            triton_url=args.triton_url, db_path=args.db, api_key=args.api_key, max_in_flight=args.max_in_flight,
            retry_after_s=args.retry_after, served_model_name=args.served_model_name, triton_model=args.triton_model,
            encoder_model=args.encoder_model, max_input_chars=args.max_input_chars,
            max_new_tokens_limit=args.max_new_tokens_limit, max_upload_bytes=int(args.max_upload_mb * 2**20),
            max_reference_seconds=args.max_reference_seconds, triton_timeout_s=args.triton_timeout,
            live_idle_timeout_s=args.live_idle_timeout, openai_models=args.openai_models, fish_models=args.fish_models,
            openai_voice=args.openai_voice,
            decoder_model=args.decoder_model, max_decode_frames=args.max_decode_frames,
            ref_audio_hosts=args.ref_audio_hosts, ref_audio_dir=args.ref_audio_dir, ref_audio_timeout_s=args.ref_audio_timeout)
        app = create_app(cfg)
    except ValueError as e:  # a setting that cannot be used (a --ref-audio-hosts entry, ...)
        build_parser().error(str(e))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
