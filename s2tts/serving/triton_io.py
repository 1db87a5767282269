"""Triton's side of the model adapters: config.pbtxt parameters, request inputs read and checked, and responses
and error responses built.

Readers take plain values (the parsed model config, numpy arrays) where they can, so they are tested without Triton;
`triton_python_backend_utils` exists only inside a model process and is imported where a Triton type is needed.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np

from ..ar.sampling import SamplingParams
from ..errors import S2Error, from_exception, internal, invalid
from ..settings import (
    SAMPLING_FIELDS,
    check_field,
    field_default,
    parse_bool,
    stage_fields,
)


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
        value = parse_bool(raw) if raw else False
        if value is not None:
            return value
        raise ValueError(f"config.pbtxt parameter {key}={raw!r}: use true or false")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"config.pbtxt parameter {key}={raw!r} is not a valid {kind.__name__}") from None


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
        raise invalid(f"{name} must hold one value, got {arr.size}", name)
    v = arr.reshape(-1)[0]
    if kind is str:
        try:
            return v.decode("utf-8", errors="strict") if isinstance(v, bytes) else str(v)
        except UnicodeDecodeError:
            raise invalid(f"{name} is not valid UTF-8 text", name) from None
    if kind is bool:
        return bool(v)
    if kind is float and not np.isfinite(v):
        raise invalid(f"{name} must be a finite number", name)
    return kind(v)


def read_fields(request, stage: str, values: dict | None = None) -> dict:
    """Every request field model `stage` takes (`settings.REQUEST_FIELDS`), as the schema declares it: a scalar as
    its Python type, an array as sent (numpy); a field left out is its default (`settings.field_default`: the
    model's setting `values` where the field has one). Ranges are checked where the fields are used
    (`sampling_params`, `frontend.request.TTSRequest.validate`)."""
    out = {}
    for f in stage_fields(stage):
        if f.dims == "[ 1 ]":
            out[f.name] = scalar(request, f.name, f.type, field_default(f.name, values))
        else:
            out[f.name] = optional_input(request, f.name)
    return out


def sampling_params(fields: dict, limits: dict | None = None, check: bool = True):
    """The sampling fields of a request (`read_fields`) -> `SamplingParams`, each checked against its range in
    `settings.REQUEST_FIELDS` (upper bounds from `limits`, a model's settings; None where a bound is not this
    model's to check); S2Error names the input that is wrong. `check=False` for a caller that checks them with the
    rest of its request (s2pro: `TTSRequest.validate`)."""
    for name in SAMPLING_FIELDS if check else ():
        check_field(name, fields[name], limits)
    return SamplingParams(temperature=fields["temperature"], top_p=fields["top_p"], top_k=fields["top_k"],
                          max_new_tokens=fields["max_new_tokens"], seed=fields["seed"],
                          ignore_end=bool(fields["ignore_eos"]))


class TritonResponder:
    """A request's response sender as a `lifecycle.Responder` (final = the FINAL flag); `times` (a
    `call_times.CallTimes`): how long each send took, under "send"."""

    def __init__(self, request, times=None):
        self.request = request
        self.sender = request.get_response_sender()
        self.times = times

    def send(self, response, final: bool) -> None:
        import triton_python_backend_utils as pb_utils

        t = time.perf_counter()
        if final:
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self.sender.send(response)
        if self.times is not None:
            self.times.add("send", time.perf_counter() - t)

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()


def s2_error_response(err):
    """An error response carrying the S2Error's class tag (`[s2tts:code:param] message`) and Triton code."""
    return error_response(err.wire(), err.triton_code)


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
    """The `waveform` + `sample_rate` inputs of a dac_encoder request, checked (S2Error says what to change)."""
    wav = optional_input(request, "waveform")
    sr = scalar(request, "sample_rate", int, None)
    if wav is None or wav.size == 0:
        raise invalid("waveform is empty: send the samples of the reference clip", "waveform")
    if sr is None or not (8000 <= sr <= 192000):
        raise invalid(f"sample_rate must be between 8000 and 192000 Hz (got {sr})", "sample_rate")
    wav = wav.astype(np.float32).reshape(-1)
    if not np.all(np.isfinite(wav)):
        raise invalid("waveform holds NaN or infinite samples: send float PCM in [-1, 1]", "waveform")
    if wav.size / sr > max_seconds:
        raise invalid(f"waveform is {wav.size / sr:.1f} s long, over the limit of {max_seconds:g} s: trim it", "waveform")
    return wav, sr


def read_fast_rows(request, dim: int, num_semantic: int, max_rows: int) -> dict[str, np.ndarray]:
    """A fast_ar request's inputs, checked (S2Error says what to change): `hidden` [B, dim], and one value a row of
    `code0` (a semantic code, in [0, num_semantic)), `temperature`, `top_p`, `top_k`, `seed` (each in its request
    field's range, `settings.REQUEST_FIELDS`) and `step` (>= 0). A code outside the embedding table would be a
    device-side assert on a GPU, which ends the model's process for every caller."""
    hidden = optional_input(request, "hidden")
    if hidden is None or hidden.ndim != 2 or hidden.shape[1] != dim or hidden.shape[0] == 0:
        raise invalid(f"hidden must be [rows, {dim}] with at least one row, got "
                      f"{None if hidden is None else list(hidden.shape)}", "hidden")
    B = hidden.shape[0]
    if B > max_rows:
        raise invalid(f"at most {max_rows} rows per request (got {B}): raise the setting fast_ar_max_batch", "hidden")
    out = {"hidden": hidden}
    for name in ("code0", "temperature", "top_p", "top_k", "seed", "step"):
        a = optional_input(request, name)
        if a is None or a.size != B:
            raise invalid(f"{name} must hold one value a row ({B}), got {0 if a is None else a.size}", name)
        out[name] = a = a.reshape(-1)
        if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
            raise invalid(f"{name} must be finite numbers", name)
    if out["code0"].min() < 0 or out["code0"].max() >= num_semantic:
        raise invalid(f"code0 must be semantic codes in [0, {num_semantic})", "code0")
    for name in ("temperature", "top_p", "top_k", "seed"):
        a = out[name]
        for v in (a.min(), a.max()):
            check_field(name, v.item())
    if out["step"].min() < 0:
        raise invalid("step must be >= 0 (the frame's index in its request)", "step")
    return out


def decode_chunk_requests(decoder, requests, now: float, name: str = "dac_decoder") -> list:
    """dac_decoder's execute over a StreamDecoder: one chunk per request (`codes` [1, frames, C], `stream_id`,
    `start`, `final`), decoded together; a bad request or a failed decode gets an error response (with its class),
    the others their audio."""
    import triton_python_backend_utils as pb_utils


    jobs, results = [], {}
    for i, request in enumerate(requests):
        try:
            codes = pb_utils.get_input_tensor_by_name(request, "codes").as_numpy()
            sid = scalar(request, "stream_id", str, None)
            if not sid:
                raise invalid("stream_id is required", "stream_id")
            start = scalar(request, "start", bool, False)
            final = scalar(request, "final", bool, False)
            if codes.ndim < 2:
                raise invalid(f"codes must be [frames, num_codebooks], got {list(codes.shape)}", "codes")
            jobs.append((i, sid, codes.reshape(codes.shape[-2], codes.shape[-1]), start, final))
        except Exception as e:  # noqa: BLE001
            results[i] = from_exception(e, name)
    try:
        results.update(decoder.decode_many(jobs, now=now))
    except Exception as e:  # noqa: BLE001
        err = from_exception(e, name)
        results.update({i: err for i, *_ in jobs if i not in results})
    out = []
    sids = {i: sid for i, sid, *_ in jobs}
    for i in range(len(requests)):
        r = results.get(i)
        if isinstance(r, np.ndarray):
            out.append(pb_utils.InferenceResponse(output_tensors=[tensor("audio", r[None])]))
        else:
            err = r if isinstance(r, S2Error) else internal(f"{name}: no result for this chunk")
            logging.getLogger("s2tts").warning("%s: stream %s (request %s) failed: %s", name, sids.get(i, "?"),
                                               requests[i].request_id(), err.wire())
            out.append(s2_error_response(err))
    return out

