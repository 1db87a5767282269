"""Small helpers shared by the `model.py` adapters of the model repository.

They take plain values (the parsed model config, numpy arrays) so they can be
tested without Triton; `pb_utils` is imported lazily where a Triton type is needed.
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def get_param(model_config: dict | str, key: str, kind=str, default=None):
    """The one typed reader of `parameters { key: ... }` in config.pbtxt.

    Values left as `${...}` placeholders count as unset.
    """
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    raw = model_config.get("parameters", {}).get(key, {}).get("string_value")
    if raw is None or raw.startswith("${"):
        return default
    raw = raw.strip()
    if kind is bool:
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"config.pbtxt parameter {key}={raw!r}: use true or false")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {key}={raw!r} is not a valid {kind.__name__}") from None


def codec_precision(dtype: str, tf32: bool) -> None:
    """Process-wide matmul/convolution precision for a codec process running fp32: `tf32=False` gives
    fp32-exact convolutions (~2e-5 from the CPU result on an H200), `tf32=True` lets cuDNN use TF32
    (about 2x faster for the decoder at batch 32-64; see perf/RESULTS.md for its deviation)."""
    if dtype in ("fp32", "float32"):
        import torch

        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32


def setup_logging(name: str) -> logging.Logger:
    """Log lines from a model process go to stderr with the model's name, which Triton passes through."""
    log = logging.getLogger("s2tts")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[s2tts:{name}] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class BadInput(ValueError):
    """A client error; its message says what to change."""


def optional_input(request, name: str):
    """numpy array of an optional input, or None (pb_utils is imported by the caller's process)."""
    import triton_python_backend_utils as pb_utils

    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy()


def scalar(request, name: str, kind, default):
    arr = optional_input(request, name)
    if arr is None or arr.size == 0:
        return default
    if arr.size != 1:
        raise BadInput(f"{name} must hold one value, got {arr.size}")
    v = arr.reshape(-1)[0]
    if kind is str:
        return v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v)
    if kind is bool:
        return bool(v)
    if kind is float and not np.isfinite(v):
        raise BadInput(f"{name} must be a finite number")
    return kind(v)


def error_response(message: str, code: str = "INVALID_ARG"):
    import triton_python_backend_utils as pb_utils

    err_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, err_code))


def tensor(name: str, array):
    import triton_python_backend_utils as pb_utils

    return pb_utils.Tensor(name, np.ascontiguousarray(array))


def string_tensor(name: str, s: str):
    return tensor(name, np.array([s.encode("utf-8")], dtype=object))


def read_waveform(request, max_seconds: float) -> tuple[np.ndarray, int]:
    """The `waveform` + `sample_rate` inputs of a dac_encoder request, checked (ValueError says what to change)."""
    import triton_python_backend_utils as pb_utils

    wav = pb_utils.get_input_tensor_by_name(request, "waveform").as_numpy().astype(np.float32).reshape(-1)
    sr = int(pb_utils.get_input_tensor_by_name(request, "sample_rate").as_numpy().reshape(-1)[0])
    if not (8000 <= sr <= 192000):
        raise ValueError(f"sample_rate must be between 8000 and 192000 Hz (got {sr})")
    if wav.size / sr > max_seconds:
        raise ValueError(f"waveform is {wav.size / sr:.1f} s long, over the limit of {max_seconds:g} s: trim it")
    return wav, sr


def decode_chunk_requests(decoder, requests, now: float) -> list:
    """dac_decoder's execute over a StreamDecoder: one chunk per request (`codes` [1, C, n], `stream_id`, `final`),
    decoded together; a bad request or a failed decode gets an error response, the others their audio."""
    import triton_python_backend_utils as pb_utils

    jobs, errors = [], {}
    for i, request in enumerate(requests):
        try:
            codes = pb_utils.get_input_tensor_by_name(request, "codes").as_numpy()
            sid = pb_utils.get_input_tensor_by_name(request, "stream_id").as_numpy().reshape(-1)[0]
            final = bool(pb_utils.get_input_tensor_by_name(request, "final").as_numpy().reshape(-1)[0])
            sid = sid.decode() if isinstance(sid, bytes) else str(sid)
            jobs.append((i, sid, codes.reshape(codes.shape[-2], codes.shape[-1]), final))
        except Exception as e:
            errors[i] = f"dac_decoder: bad request: {e}"
    results = {}
    try:
        results = decoder.decode_many(jobs, now=now)
    except ValueError as e:
        errors.update({i: str(e) for i, *_ in jobs if i not in errors})
    except Exception as e:
        errors.update({i: f"dac_decoder: {e}" for i, *_ in jobs if i not in errors})
    return [pb_utils.InferenceResponse(output_tensors=[tensor("audio", results[i][None])]) if i in results
            else error_response(errors.get(i, "dac_decoder: no result")) for i in range(len(requests))]
