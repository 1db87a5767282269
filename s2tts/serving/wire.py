"""What slow_ar's answers carry besides codes and audio, as numbers: finish reasons, a request's final stats, a
status answer. A decoupled BLS response is loaded by the receiving Python stub on a thread that does not hold the
GIL, and a STRING tensor is decoded there by Python code, which crashed the s2pro process under load: numbers only on
that wire."""

from __future__ import annotations

import numpy as np

FINISH_CODES = {"": 0, "end": 1, "length": 2, "cancelled": 3}
FINISH_NAMES = {v: k for k, v in FINISH_CODES.items()}
# the final response's `stats`; first_frame_s / first_audio_s: seconds from the request's arrival here to its first
# frame made / its first chunk handed to the sender (where a stream's time to first audio goes: perf/loadgen.py)
STATS_FIELDS = ("frames", "queue_s", "prompt_tokens", "first_frame_s", "first_audio_s")
STATUS_FIELDS = ("healthy", "waiting", "live", "free_slots", "in_flight", "request")  # a `status` answer
REQUEST_STATES = ("unknown", "waiting", "live")


def encode_fields(values: dict, fields) -> np.ndarray:
    """dict -> float32 vector in `fields` order (None -> -1; booleans -> 0/1; request states -> their index)."""
    out = []
    for f in fields:
        v = values.get(f)
        if f == "request":
            v = REQUEST_STATES.index(v) if v in REQUEST_STATES else 0
        out.append(-1.0 if v is None else float(v))
    return np.array(out, np.float32)


def decode_fields(arr, fields) -> dict:
    vals = [float(x) for x in np.asarray(arr).reshape(-1)]
    out = {}
    for f, v in zip(fields, vals):
        if f == "request":
            out[f] = REQUEST_STATES[int(v)] if 0 <= int(v) < len(REQUEST_STATES) else "unknown"
        elif f == "healthy":
            out[f] = v > 0.5
        elif f.endswith("_s"):  # seconds
            out[f] = None if v < 0 else round(v, 4)
        else:
            out[f] = int(v)
    return out
