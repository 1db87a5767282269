"""What slow_ar's answers carry besides codes and audio, as numbers: finish reasons, a request's final stats, a
status answer. A decoupled BLS response is loaded by the receiving Python stub on a thread that does not hold the
GIL, and a STRING tensor is decoded there by Python code, which crashed the s2pro process under load: numbers only on
that wire."""

from __future__ import annotations

import numpy as np

# every answer of slow_ar carries each of these (a group answer's two last not empty), and every BLS call to it asks
# for each: Triton 24.10's Python stub crashes sending an answer to a BLS call that did not ask for all its outputs
SLOW_AR_OUTPUTS = ("codes", "finish_reason", "stats", "audio", "items", "error_text")
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


# a group pull's answer (slow_ar's `control`="next_group"): `items` [m, len(GROUP_COLUMNS)] int32, a row an item in
# order, its codes and audio the next `frames` rows and `samples` samples of the answer's; its stats the next `stats`
# numbers of `stats` (STATS_FIELDS on a final item), an error the next `error` bytes of `error_text` (int32 [-1], a
# byte each: the UTF-8 of the error's wire form). int32 and float32 alone, the types slow_ar's answers always had
GROUP_COLUMNS = ("key", "frames", "samples", "finish", "stats", "error")


def encode_group(items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[(key, frames, samples, finish reason, encoded stats, error wire text or "")] -> (items, stats, error_text)."""
    rows, stats, text = [], [], []
    for key, frames, samples, reason, st, err in items:
        msg = err.encode() if err else b""
        rows.append((key, frames, samples, FINISH_CODES[reason], st.size, len(msg)))
        stats.append(st.astype(np.float32).reshape(-1))
        text.append(msg)
    return (np.array(rows, np.int32).reshape(-1, len(GROUP_COLUMNS)),
            np.concatenate(stats) if stats else np.zeros(0, np.float32),
            np.frombuffer(b"".join(text), np.uint8).astype(np.int32))


def decode_group(items, stats, error_text) -> list[tuple[int, int, int, str, dict | None, str | None]]:
    """`encode_group`'s arrays -> [(key, frames, samples, finish reason, stats dict or None, error text or None)]."""
    out, at_s, at_e = [], 0, 0
    text = np.asarray(error_text).astype(np.uint8).tobytes()
    stats = np.asarray(stats, np.float32).reshape(-1)
    for key, frames, samples, finish, ns, ne in np.asarray(items).reshape(-1, len(GROUP_COLUMNS)).tolist():
        st = decode_fields(stats[at_s:at_s + ns], STATS_FIELDS) if ns else None
        err = text[at_e:at_e + ne].decode(errors="replace") if ne else None
        at_s, at_e = at_s + ns, at_e + ne
        out.append((key, frames, samples, FINISH_NAMES.get(finish, ""), st, err))
    return out
