"""Error classes that travel with a failed request, across models, the gRPC stream and the gateway.

Triton's gRPC stream keeps only an error's message, so the class rides at the front of it:

    [s2tts:invalid_argument:text] text is empty: give the words to speak

`S2Error.wire()` writes that; `parse()` reads it back from any message (an untagged one,
e.g. Triton's own "Stub process ... is not healthy", gets a class by `classify_untagged`).
Clients read `code` and `param` without parsing the prose; the gateway maps `code` to an
HTTP status through `HTTP_STATUS`, never by the message text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# code -> (Triton error code name, HTTP status)
CODES: dict[str, tuple[str, int]] = {
    "invalid_argument": ("INVALID_ARG", 400),  # a field is wrong; `param` names it
    "not_found": ("NOT_FOUND", 404),  # e.g. an unknown codec stream or voice
    "already_exists": ("ALREADY_EXISTS", 409),  # e.g. a request id that is already live
    "too_large": ("INVALID_ARG", 413),  # an input over a size limit (bytes, seconds, characters)
    "unsupported_media": ("UNSUPPORTED", 415),  # audio that cannot be decoded
    "resource_exhausted": ("UNAVAILABLE", 429),  # the device ran out of memory for this request: retry later
    "cancelled": ("CANCELLED", 499),  # the caller cancelled
    "internal": ("INTERNAL", 500),  # a fault in a model: the request failed, the server goes on
    "unavailable": ("UNAVAILABLE", 503),  # busy, not ready, shutting down, or unhealthy: retry later
    "deadline_exceeded": ("UNAVAILABLE", 504),  # the request ran out of time
}
HTTP_STATUS = {code: http for code, (_, http) in CODES.items()}
RETRYABLE = {"resource_exhausted", "unavailable", "deadline_exceeded"}

_TAG = re.compile(r"^\[s2tts:([a-z_]+)(?::([A-Za-z0-9_.]+))?\] ?")


@dataclass
class S2Error(Exception):
    """A request failure with a stable class (`code`), the input it concerns (`param`) and a message
    that says what to change."""

    code: str
    message: str
    param: str | None = None

    def __post_init__(self):
        if self.code not in CODES:
            raise ValueError(f"unknown error code {self.code!r}: use one of {sorted(CODES)}")
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    def wire(self) -> str:
        """The message as sent to the next hop: the class tag, then the prose."""
        return f"[s2tts:{self.code}{':' + self.param if self.param else ''}] {self.message}"

    @property
    def triton_code(self) -> str:
        return CODES[self.code][0]

    @property
    def http_status(self) -> int:
        return CODES[self.code][1]

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE


class InvalidArgument(S2Error, ValueError):
    """invalid_argument, also a ValueError (what Python code raises for a bad value)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__("invalid_argument", message, param)


def make(code: str, message: str, param: str | None = None) -> S2Error:
    return InvalidArgument(message, param) if code == "invalid_argument" else S2Error(code, message, param)


def invalid(message: str, param: str | None = None) -> S2Error:
    return InvalidArgument(message, param)


def unavailable(message: str) -> S2Error:
    return S2Error("unavailable", message)


SHUTDOWN = "shutdown"  # the `param` of an `unavailable` error from a model that is being unloaded on purpose


def shutting_down(model: str) -> S2Error:
    return S2Error("unavailable", f"{model} is shutting down; retry on another server or after the restart", SHUTDOWN)


def internal(message: str) -> S2Error:
    return S2Error("internal", message)


SERVER_STOPPING = "server not ready"  # Triton's words for a call made while it stops (a BLS call in flight)

# Untagged messages come from Triton itself or from a model process that died; these mean "the model
# cannot serve now" rather than "your input is wrong".
_UNAVAILABLE_HINTS = ("unknown model", "is not ready", "not healthy", "stub process", "failed to connect",
                      "model is unavailable", "is not found", "unavailable",
                      # the connection to the server broke (gRPC's words): retry, on this server or another
                      "stream removed", "socket closed", "connection reset", "goaway")


def classify_untagged(message: str, triton_code: str | None = None) -> str:
    low = message.lower()
    if triton_code in ("UNAVAILABLE",) or any(h in low for h in _UNAVAILABLE_HINTS):
        return "unavailable"
    if triton_code == "INVALID_ARG":
        return "invalid_argument"
    if triton_code == "NOT_FOUND":
        return "not_found"
    if triton_code == "ALREADY_EXISTS":
        return "already_exists"
    if triton_code == "CANCELLED":
        return "cancelled"
    if "out of memory" in low:
        return "resource_exhausted"
    return "internal"


def is_tagged(message: str) -> bool:
    m = _TAG.match(message or "")
    return bool(m and m.group(1) in CODES)


def parse(message: str, triton_code: str | None = None) -> S2Error:
    """The S2Error a message carries (its tag), or the class `classify_untagged` gives it."""
    message = message or ""
    m = _TAG.match(message)
    if m and m.group(1) in CODES:
        return make(m.group(1), message[m.end():], m.group(2))
    if SERVER_STOPPING in message.lower():  # tritonserver's answer to a call while it stops: no model is at fault
        return S2Error("unavailable", f"the server is shutting down ({message}); retry on another server or after "
                                      "the restart", SHUTDOWN)
    return make(classify_untagged(message, triton_code), message)


GAVE_UP = "is unavailable after an unrecoverable fault"  # a model's own verdict (lifecycle.Health): it unloads itself


def model_is_dead(message: str) -> bool:
    """Triton's words for a Python model whose process is gone, or the model's own verdict after an unrecoverable
    fault (`GAVE_UP`): either way it never answers again until reloaded. (Its self-unload may not have made Triton
    report it not ready yet when its requests fail, so readiness alone does not tell.)"""
    low = (message or "").lower()
    return ("stub process" in low and ("not healthy" in low or "unhealthy" in low)) or GAVE_UP in low


def from_exception(exc: BaseException, where: str = "") -> S2Error:
    """Any exception as an S2Error: S2Error as is, ValueError as invalid_argument, device out-of-memory as
    resource_exhausted, anything else as internal (named by `where`)."""
    if isinstance(exc, S2Error):
        return exc
    prefix = f"{where}: " if where else ""
    if is_out_of_memory(exc):
        return S2Error("resource_exhausted", f"{prefix}the device ran out of memory for this request; retry later "
                                             f"or with a shorter text or reference ({exc})")
    if isinstance(exc, ValueError):
        return invalid(str(exc))
    return internal(f"{prefix}{type(exc).__name__}: {exc}")


def is_out_of_memory(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name == "OutOfMemoryError" or "out of memory" in str(exc).lower()


# CUDA errors that poison the process's context: every later call fails the same way.
_STICKY = ("illegal memory access", "device-side assert", "unspecified launch failure", "misaligned address",
           "illegal instruction", "an illegal", "cuda error: unknown error", "uncorrectable ecc", "device not ready",
           "cudaerrorlaunchfailure", "hardware stack error", "cuda-capable device(s) is/are busy or unavailable",
           "cublas_status_execution_failed", "cuda driver error")


def is_fatal_device_error(exc: BaseException) -> bool:
    """A device error the process cannot recover from (sticky CUDA errors). Out-of-memory is not one."""
    if is_out_of_memory(exc):
        return False
    low = str(exc).lower()
    return any(s in low for s in _STICKY)
