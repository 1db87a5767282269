"""A model process's own life under Triton: logging, loading on the first request, unloading or reloading
itself, and exiting without the interpreter's teardown."""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import time

from ..errors import from_exception
from .profiler import start_from_env
from .triton_io import s2_error_response

_EXIT_REGISTERED = False


def exit_without_teardown() -> None:
    """At the model process's exit (after Triton's finalize, once every other exit handler registered after this
    one has run), flush stdout and stderr and end the process at once: the interpreter's teardown of PyTorch and
    the other modules took ~2 s of each model's unload on a CPU, which every server stop, restart and model reload
    waits for. Nothing is lost: the model's `finalize` and the exit handlers registered later (the stack sampler's
    report) run first."""
    global _EXIT_REGISTERED
    if _EXIT_REGISTERED:
        return
    _EXIT_REGISTERED = True

    def _exit() -> None:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
                pass
        os._exit(0)

    atexit.register(_exit)


def setup_logging(name: str) -> logging.Logger:
    """Log lines from a model process go to stderr with the model's name, which Triton passes through. A model
    process that crashes (a fatal signal) prints every thread's Python stack there first (faulthandler), and one
    sent SIGUSR1 prints them and goes on (where a model seems stuck: `kill -USR1 <its triton_python_backend_stub>`;
    unless the process already handles that signal). With `S2TTS_PROFILE_DIR` set, the process also samples its
    threads' stacks there (`profiler.StackSampler`). Once Triton has finalized the model, its process exits without
    the interpreter's teardown (`exit_without_teardown`)."""

    exit_without_teardown()
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:  # (SIG_DFL: it would end)
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    log = logging.getLogger("s2tts")
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[s2tts:{name}] %(levelname)s %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    sampler = start_from_env(name)
    if sampler is not None:
        log.info("%s: sampling thread stacks every %g ms into %s", name, sampler.interval_s * 1e3, sampler.text_path)
    return log


def load_on_first_request(load, requests, name: str, log, what: str) -> list | None:
    """A model that holds its weights only once a direct caller comes: `load()` them now -> None, or, if that
    failed, one error response per request (the next request tries again)."""
    try:
        load()
        return None
    except Exception as e:  # noqa: BLE001 - these requests fail; the next one tries again

        err = from_exception(e, name)
        log.error("%s: loading %s failed: %s", name, what, err.wire())
        return [s2_error_response(err) for _ in requests]


def unload_self(name: str, log) -> bool:
    """Ask Triton to unload this model (so readiness reports it), which works with --model-control-mode=explicit;
    otherwise say what the operator must do."""
    import triton_python_backend_utils as pb_utils

    try:
        pb_utils.unload_model(name)
        log.error("%s: unloading itself after an unrecoverable fault; Triton reports it not ready until it is "
                  "loaded again (s2pro reloads it when auto_recover=true)", name)
        return True
    except Exception as e:  # noqa: BLE001 - not in explicit model control mode
        log.error("%s: could not unload itself (%s): it refuses every request with `unavailable`; restart "
                  "tritonserver, or run it with --model-control-mode=explicit so the model can be reloaded", name, e)
        return False


def reload_model(name: str, timeout_s: float = 600.0) -> None:
    """Unload `name` (if loaded) and load it again: a new process, a fresh device context. Needs
    --model-control-mode=explicit."""

    import triton_python_backend_utils as pb_utils

    try:
        pb_utils.unload_model(model_name=name)
    except Exception:  # noqa: BLE001 - already unloaded (it may have unloaded itself)
        pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and pb_utils.is_model_ready(model_name=name):
        time.sleep(0.2)
    pb_utils.load_model(model_name=name)
    deadline = time.monotonic() + timeout_s
    while not pb_utils.is_model_ready(model_name=name):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready {timeout_s:g} s after its reload")
        time.sleep(0.2)
