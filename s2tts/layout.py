"""Where the pipeline runs: one `slow_ar` engine per device of `device`, one `dac_decoder` per device of
`codec_device` (both comma-separated lists; one device each by default).

    device=cuda:0,cuda:1                      two engines, each with its codec beside it
    device=cuda:0,cuda:1 codec_device=cuda:2  two engines, one codec on a third GPU that both use
    device=cpu,cpu                            two engines on the CPU (tests)

The first replica keeps the plain model names (`slow_ar`, `dac_decoder`); replica i > 0 is `slow_ar_i` /
`dac_decoder_i`, a copy of the same model with its own device. Engine i sends its streams to decoder
i mod (number of decoders). `dac_encoder` (stateless) runs once, on the first codec device. s2pro places
each request on the engine with the fewest requests (ties go to the voice's usual engine, whose prefix
cache holds it) and keeps the whole request there, codec stream included, so a stream's decoder state
never moves. This module is the one place that knows these names; rendering, s2pro and the tests read
them here.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

from .errors import invalid

ENGINE, ENCODER, DECODER = "slow_ar", "dac_encoder", "dac_decoder"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_REPLICA = re.compile(r"^(slow_ar|dac_decoder)_(\d+)$")


def parse_devices(value: str | None, key: str = "device") -> tuple[str, ...]:
    """"cuda:0, cuda:1" -> ("cuda:0", "cuda:1"); each `auto`, `cpu`, `cuda` or `cuda:N`; `auto` only alone."""
    items = tuple(d.strip() for d in str(value if value is not None else "auto").split(","))
    bad = [d for d in items if not _DEVICE.match(d)]
    if bad:
        raise invalid(f"setting {key}={value!r}: {bad[0]!r} is not a device; use cpu, cuda, cuda:N or auto, or a "
                      "comma-separated list of them (one model replica per entry)", key)
    if len(items) > 1 and "auto" in items:
        raise invalid(f"setting {key}={value!r}: `auto` stands alone; list the devices (e.g. cuda:0,cuda:1)", key)
    return items


def _concrete(device: str) -> tuple[str, int]:
    """"auto" / "cuda" / "cuda:N" / "cpu" -> (type, index): auto is CUDA when torch sees a GPU (the launcher's view,
    as the models' own `auto` is)."""
    if device == "auto":
        import torch  # here only: the gateway and the launcher read layouts without importing torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = device.partition(":")
    return kind, int(index or 0)


def replica_name(role: str, i: int) -> str:
    return role if i == 0 else f"{role}_{i}"


def role_of(model: str) -> str:
    """`slow_ar_2` -> `slow_ar`; other names are their own role."""
    m = _REPLICA.match(model)
    return m.group(1) if m else model


@dataclass(frozen=True)
class Layout:
    engines: tuple[str, ...]  # device of each slow_ar replica
    codecs: tuple[str, ...]  # device of each dac_decoder replica

    @classmethod
    def from_values(cls, values: dict) -> "Layout":
        engines = parse_devices(values.get("device"), "device")
        codecs = parse_devices(values.get("codec_device") or values.get("device"), "codec_device")
        if len(codecs) > len(engines):
            raise invalid(f"codec_device lists {len(codecs)} devices but device lists {len(engines)} engines: "
                          "give at most one codec per engine", "codec_device")
        return cls(engines, codecs)

    @property
    def replicas(self) -> int:
        return len(self.engines)

    def engine(self, i: int) -> str:
        return replica_name(ENGINE, i)

    def codec_of(self, i: int) -> int:
        """Which codec (dac_decoder replica, and its device in `codecs`) engine i's streams use."""
        return i % len(self.codecs)

    def decoder(self, i: int) -> str:
        """The dac_decoder that engine i's streams use."""
        return replica_name(DECODER, self.codec_of(i))

    def models(self, role: str) -> list[tuple[str, str]]:
        """(model name, device) of every replica of `role` (slow_ar or dac_decoder)."""
        devices = self.engines if role == ENGINE else self.codecs
        return [(replica_name(role, i), d) for i, d in enumerate(devices)]

    def replica_models(self) -> list[str]:
        """The names beyond the five plain models."""
        return [name for role in (ENGINE, DECODER) for name, _ in self.models(role)[1:]]

    def engines_on_gpu(self) -> bool:
        """Every engine on a CUDA device (`auto` as the models decide it)."""
        return all(_concrete(e)[0] == "cuda" for e in self.engines)

    def codec_beside_engines(self) -> bool:
        """Every engine on a GPU with its codec on that same GPU: what `codec_in_engine=auto` turns on for."""
        devs = [(_concrete(e), _concrete(self.codecs[self.codec_of(i)])) for i, e in enumerate(self.engines)]
        return all(e[0] == "cuda" and e == c for e, c in devs)

    def preferred(self, key: str) -> int:
        """The replica a voice (its reference transcript, or "" for none) goes to when loads are equal."""
        return zlib.crc32(key.encode()) % self.replicas
