"""The container's start: tritonserver and the gateway (`s2tts.launch`), or one of them, with the container's paths.

    docker run IMAGE [--set KEY=VALUE ...]        tritonserver + gateway (python -m s2tts.launch)
    docker run IMAGE server [--set KEY=VALUE ...] tritonserver alone (python -m s2tts.server; compose, Kubernetes)
    docker run IMAGE gateway --triton-url HOST:8001 [...]   the gateway alone (python -m s2tts.gateway)

Every setting (README: Settings) may also come from the environment as S2TTS_<KEY>=VALUE (S2TTS_MAX_BATCH=64 is
`--set max_batch=64`); an argument wins over the environment. S2TTS_CHECKPOINT is the checkpoint directory (default
/models/s2-pro, a volume); the voice store is /data/voices.sqlite3 (a volume) unless S2TTS_VOICE_DB names one
(gateway). The ports listen on all of the container's addresses: publishing them is what exposes them.
This process becomes the server's own (exec), so that `docker stop` (SIGTERM) reaches it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from s2tts.settings import SCHEMA

CHECKPOINT = "/models/s2-pro"
VOICES = "/data/voices.sqlite3"
OUT = "/tmp/s2tts"  # logs, the rendered model repository, the demo request's WAV


def env_settings(environ) -> list[str]:
    """`--set` arguments for the settings given as S2TTS_<KEY> variables (the checkpoint has its own option)."""
    out = []
    for key in SCHEMA:
        value = environ.get(f"S2TTS_{key.upper()}")
        if key != "checkpoint" and value not in (None, ""):
            out += ["--set", f"{key}={value}"]
    return out


def last_value(args: list[str], option: str) -> str | None:
    value = None
    for i, a in enumerate(args):
        if a == option and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(option + "="):
            value = a.split("=", 1)[1]
    return value


def checkpoint_problem(path: Path) -> str | None:
    """What keeps the servers' user from loading the checkpoint at `path`, said as what to change; None if nothing."""
    if not (path / "config.json").is_file():
        return (f"no S2 Pro checkpoint at {path} (no config.json): mount one there, e.g. docker run -v "
                f"/path/to/s2-pro:{CHECKPOINT}:ro ..., or name another directory with S2TTS_CHECKPOINT")
    unreadable = [f.name for f in sorted(path.iterdir()) if f.is_file() and not os.access(f, os.R_OK)]
    if unreadable:
        return (f"the checkpoint's files {', '.join(unreadable[:4])} are not readable by uid {os.getuid()}, the "
                f"container's user: make them readable (chmod -R a+rX on the host) or run with --user <their owner>")
    return None


def command(args: list[str], environ) -> list[str]:
    """The module command line (after `python -m`) for this container's arguments and environment."""
    role = args[0] if args and args[0] in ("server", "gateway") else "launch"
    rest = args[1:] if role != "launch" else args
    if role == "gateway":
        db = [] if environ.get("S2TTS_VOICE_DB") else ["--db", VOICES]
        return ["s2tts.gateway", "--host", "0.0.0.0", *db, *rest]
    ckpt = environ.get("S2TTS_CHECKPOINT") or CHECKPOINT
    given = ["--checkpoint", ckpt, *env_settings(environ)]
    if role == "server":
        return ["s2tts.server", *given, "--address", "0.0.0.0", *rest]
    return ["s2tts.launch", *given, "--host", "0.0.0.0", "--triton-address", "0.0.0.0", "--db", VOICES,
            "--out-dir", OUT, *rest]


def main() -> None:
    cmd = command(sys.argv[1:], os.environ)
    ckpt = last_value(cmd, "--checkpoint")
    problem = checkpoint_problem(Path(ckpt)) if ckpt else None
    if problem:
        sys.exit(f"error: {problem}")
    os.execv(sys.executable, [sys.executable, "-m", *cmd])


if __name__ == "__main__":
    main()
