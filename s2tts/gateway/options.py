"""Gateway settings (one dataclass; `__main__` fills it from the command line)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GatewayConfig:
    triton_url: str = "localhost:8001"
    db_path: str = "voices.sqlite3"
    api_key: str | None = None
    # speech requests streaming at once; more are answered 503 + Retry-After. None: s2pro's max_concurrent_requests,
    # read from the server (a gateway never refuses what s2pro would admit)
    max_in_flight: int | None = None
    retry_after_s: int = 1
    served_model_name: str = "s2-pro"
    model_aliases: tuple[str, ...] = ("s2pro", "fishaudio/s2-pro", "fishaudio/openaudio-s2-pro")
    # OpenAI's model names, served as aliases of the model, so that an app written for OpenAI works by its base URL
    # alone; () = only the model's own names
    openai_models: tuple[str, ...] = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    # Fish Audio's model names (its `model` header; s2.1-pro is its default, speech-1.5 the older SDK's), served as
    # aliases on its routes (/v1/tts and the live WebSocket) likewise; () = only the model's own names
    fish_models: tuple[str, ...] = ("s1", "s2.1-pro", "speech-1.5", "speech-1.6")
    # what OpenAI's built-in voice names (protocol.OPENAI_VOICES) speak with when no voice of that name is registered:
    # "default" (no reference voice), a registered voice's name, or None (they are unknown names: 404)
    openai_voice: str | None = "default"
    triton_model: str = "s2pro"
    encoder_model: str = "dac_encoder"
    decoder_model: str = "dac_decoder"
    # Request limits: unset (None) = the served model's own (s2pro's settings, read from Triton; see
    # s2tts.settings); set = a stricter limit at the gateway.
    max_input_chars: int | None = None
    max_new_tokens_limit: int | None = None
    max_upload_bytes: int = 10 * 1024 * 1024  # voice uploads; inline ref_audio is limited to the same decoded size
    max_reference_seconds: float | None = None
    # fish-speech's /v1/vqgan/decode: the most frames one call decodes (all its token arrays together; 21.5 frames
    # per second of S2 Pro audio), each array's audio made by dac_decoder one chunk after another
    max_decode_frames: int = 6000
    # ref_audio as a URL (remote_audio.py), off unless set: http(s) only from these hosts, IP addresses or networks,
    # or URL prefixes (private and loopback addresses only where an address or network here names them); file://
    # only under this directory; the whole fetch within ref_audio_timeout_s, at most max_upload_bytes
    ref_audio_hosts: tuple[str, ...] = ()
    ref_audio_dir: str | None = None
    ref_audio_timeout_s: float = 10.0
    # the longest silence between two responses of an s2pro stream (and the longest dac_encoder call); None: s2pro's
    # request_timeout_s (its deadline for each text segment) + 30 s, read from the server. No limit on a stream's
    # total length: a long text runs segment after segment, each with its own deadline in s2pro.
    triton_timeout_s: float | None = None
    limits_ttl_s: float = 30.0  # how long the limits read from s2pro's config are reused
    # a live WebSocket (/v1/tts/live) with no session for this long is closed: before its first start event and
    # between sessions (LiveKit's plugin keeps pooled connections up to 300 s)
    live_idle_timeout_s: float = 300.0

    def limits(self, served: dict) -> dict:
        """The request limits in force: the served model's (`served`, keyed by setting name), each made stricter by
        this gateway's own setting where one is set."""
        out = dict(served)
        for key, mine in (("max_text_chars", self.max_input_chars), ("max_new_tokens_limit", self.max_new_tokens_limit),
                          ("max_reference_seconds", self.max_reference_seconds)):
            if mine is not None:
                out[key] = min(out[key], mine)
        return out

    def __post_init__(self):
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if self.api_key == "":
            self.api_key = None
        if self.max_decode_frames < 1:
            raise ValueError("max_decode_frames must be >= 1")
        if self.ref_audio_timeout_s <= 0:
            raise ValueError("ref_audio_timeout_s must be > 0")

    @property
    def model_names(self) -> set[str]:
        return {self.served_model_name, self.triton_model, *self.model_aliases, *self.openai_models}

    @property
    def max_json_body_bytes(self) -> int:
        # base64 grows a file by 4/3; leave room for the other fields.
        return self.max_upload_bytes * 4 // 3 + 1024 * 1024

    @property
    def max_form_body_bytes(self) -> int:
        return self.max_upload_bytes + 256 * 1024
