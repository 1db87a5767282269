"""What the instances of s2pro in one server share (`s2pro_instances` > 1).

Triton runs each instance of a Python-backend model in its own process and hands each request to any of them. These
must still hold for the whole server, not for each process:

- `SharedSlots`: `max_concurrent_requests` counts the requests of every instance together. Slot k is a lock on byte
  k of one file in the server's run directory, owned by that instance's open file (Linux's open file description
  locks: two `SharedSlots` of one process exclude each other too); the kernel drops them when the process dies, so
  an instance that crashed never keeps slots.
- `SessionRelay`: a text session (`session_id`) lives in the instance that opened it (its worker streams the audio).
  Text for it that reaches another instance is relayed there over that instance's Unix socket and answered as if
  it had come there. Each open session is a file in the run directory naming its owner, made exclusively, so one
  session id is open once in the whole server. The sockets are abstract (no path, so no length limit from the
  temporary directory's); an owner answers only messages carrying its key, which is in those files (mode 0600, in a
  directory of mode 0700).
- `SharedLoad`: placement on the engine with the fewest requests counts every instance's requests.
- `ReloadGate`: a model that failed is reloaded once, not once per instance that saw it fail, and the instances that
  did not see it keep new requests off it while it reloads.

The run directory (`run_dir`) is keyed by the Triton server process and the model's directory: the instances of one
server share it, two servers on one host do not, and the directories of servers that are gone are removed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from .. import errors
from ..errors import S2Error

log = logging.getLogger("s2tts")

PREFIX = "s2tts-run-"
MAX_MESSAGE = 8 << 20  # bytes of one relayed request or answer (text is bounded by max_text_chars before this)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_dir(model_dir: str, server_pid: int | None = None, base: str | None = None) -> Path:
    """The directory the instances of the model at `model_dir` in server `server_pid` (default: this process's
    parent, the tritonserver that started this instance) share; made if missing (mode 0700). Directories left by
    servers that have ended are removed on the way."""
    pid = os.getppid() if server_pid is None else server_pid
    root = Path(base or tempfile.gettempdir())
    for old in root.glob(PREFIX + "*"):
        try:
            if not _alive(int(old.name[len(PREFIX):].split("-")[0])):
                shutil.rmtree(old, ignore_errors=True)
        except ValueError:
            continue
    key = hashlib.sha1(os.path.abspath(model_dir).encode()).hexdigest()[:12]
    d = root / f"{PREFIX}{pid}-{key}"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / "sessions").mkdir(mode=0o700, exist_ok=True)
    return d


class SharedLoad:
    """Requests in flight on each engine, over the instances: each instance writes its own counts in its row of a
    small shared file (claimed with a lock, so no two live instances share a row, and zeroed by its next owner) and
    reads the others' (the rows of processes that have ended are skipped). So the fewest-requests placement sees
    every instance's requests, not only its own."""

    ROWS = 64  # instances at most (the setting's maximum)

    def __init__(self, directory: str | Path, replicas: int):
        self.replicas = replicas
        path = Path(directory) / f"load-{replicas}"
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self.ROWS * (1 + replicas) * 8
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
        self.row = next((k for k in range(self.ROWS) if _lock_byte(self._fd, k, fcntl.F_WRLCK)), None)
        if self.row is None:
            raise RuntimeError(f"more than {self.ROWS} s2pro instances share {directory}")
        self._table = np.memmap(path, dtype=np.int64, mode="r+", shape=(self.ROWS, 1 + replicas))
        self._table[self.row, 1:] = 0
        self._table[self.row, 0] = os.getpid()

    @contextlib.contextmanager
    def placing(self):
        """One placement at a time over the instances (read the others' counts, choose, publish): two requests that
        arrive together in two instances see each other."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def publish(self, counts: list[int]) -> None:
        """This instance's requests in flight on each engine."""
        self._table[self.row, 1:] = counts

    def others(self) -> list[int]:
        """The other live instances' requests in flight on each engine, summed."""
        rows = np.array(self._table)  # a copy: the other instances write meanwhile
        out = np.zeros(self.replicas, np.int64)
        for k in np.flatnonzero(rows[:, 0]):
            if k != self.row and _alive(int(rows[k, 0])):
                out += rows[k, 1:]
        return out.tolist()

    def close(self) -> None:
        self._table[self.row, 1:] = 0
        self._table[self.row, 0] = 0
        del self._table
        os.close(self._fd)


class ReloadGate:
    """One reload of a model at a time among the instances, and none right after another's: instance A and B both see
    slow_ar die; A reloads it; B, waiting meanwhile, finds that reload done and makes none of its own (a second one
    would end the requests that the fresh model already serves)."""

    def __init__(self, directory: str | Path, within_s: float):
        self.dir = Path(directory)
        self.within_s = within_s

    def busy(self, model: str) -> bool:
        """Whether an instance is reloading `model` now (it holds the lock exclusively; a process that died holds
        none). The check takes the lock shared: checks never see each other (an exclusive one would, and refuse a
        request for a reload that is not happening)."""
        try:
            with open(self.dir / f"reload-{model}.lock", "a+") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    return True
                return False
        except OSError:
            return False

    def run(self, model: str, reload: Callable[[], None], noticed: float,
            gated: threading.Event | None = None) -> bool:
        """`reload()` unless another instance finished reloading `model` after `noticed` - `within_s` (wall-clock
        seconds): True when it ran here. `gated` is set once `busy(model)` is true for every instance (this one holds
        the lock, or another does and this one waits for it)."""
        with open(self.dir / f"reload-{model}.lock", "a+") as f:
            try:  # released when the file closes (or the process dies)
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another instance reloads it: busy for all already; wait for its end
                if gated is not None:
                    gated.set()
                fcntl.flock(f, fcntl.LOCK_EX)
            if gated is not None:
                gated.set()
            stamp = self.dir / f"reloaded-{model}"
            try:
                done = float(stamp.read_text())
            except (OSError, ValueError):
                done = None
            if done is not None and done >= noticed - self.within_s:
                return False
            reload()
            stamp.write_text(repr(time.time()))
            return True


def _lock_byte(fd: int, k: int, kind: int) -> bool:
    """Byte `k` of `fd`'s file locked (`kind` F_WRLCK) or unlocked (F_UNLCK) for this open file, without waiting:
    False when another open file holds it."""
    flock = struct.pack("hhqqixxxx", kind, os.SEEK_SET, k, 1, 0)  # struct flock: type, whence, start, len, pid=0
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise
    return True


class SharedSlots:
    """`limit` slots for every `SharedSlots` that opens the same `path` (in any process). `take` -> a slot number or
    None when all are taken; `give` returns one. Thread-safe; the kernel frees a process's slots when it ends."""

    def __init__(self, path: str | Path, limit: int):
        self.limit = limit
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._held: set[int] = set()  # this object's slots (its own locks never block it: tracked here)
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> int | None:
        with self._lock:
            for i in range(self.limit):
                k = (self._next + i) % self.limit
                if k in self._held or not _lock_byte(self._fd, k, fcntl.F_WRLCK):
                    continue
                self._held.add(k)
                self._next = k + 1
                return k
        return None

    def give(self, k: int) -> None:
        with self._lock:
            if k in self._held:
                _lock_byte(self._fd, k, fcntl.F_UNLCK)
                self._held.discard(k)

    def held(self) -> int:
        """Slots this process holds."""
        with self._lock:
            return len(self._held)

    def close(self) -> None:
        with self._lock:
            self._held.clear()
            os.close(self._fd)


class SessionRelay:
    """Open text sessions across the instances sharing `directory` (`run_dir`).

    `answer(session_id, event, text) -> dict` is the owner's own handling of text for a session it holds (it may
    raise S2Error, which is relayed to the sender as the same error). `claim` when this instance opens a session,
    `release` when it ends, `relay` for text whose session is not here."""

    def __init__(self, directory: str | Path, answer: Callable[[str, str, str], dict], name: str = "s2pro",
                 timeout_s: float = 5.0):
        self.dir = Path(directory)
        self.answer = answer
        self.name = name
        self.timeout_s = timeout_s
        self.relayed = 0  # text requests this instance passed to another
        self.served = 0  # text requests another instance passed to this one
        self.key = secrets.token_hex(16)
        self.socket_path = f"\0s2tts-relay-{os.getpid()}-{secrets.token_hex(6)}"  # abstract: nothing on disk
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.socket_path)
        self._server.listen(64)
        self._server.settimeout(0.5)  # its accept wakes to see `close`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="s2tts-session-relay", daemon=True)
        self._thread.start()

    # ---- owners ------------------------------------------------------------------------------
    def _file(self, session_id: str) -> Path:
        return self.dir / "sessions" / hashlib.sha1(session_id.encode()).hexdigest()

    def _owner(self, session_id: str) -> tuple[int, str, str] | None:
        """(pid, socket, key) of the instance holding the session open, as its file says."""
        return _read_owner(self._file(session_id))

    def _owner_alive(self, owner: tuple[int, str, str]) -> bool:
        if not _alive(owner[0]):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout_s)
            try:
                s.connect(owner[1])
            except OSError:
                return False
        return True

    def claim(self, session_id: str) -> bool:
        """Make this instance the session's owner: False when another live instance holds it open."""
        f = self._file(session_id)
        mine = f"{os.getpid()}\n{self.socket_path}\n{self.key}"
        for _ in range(3):
            try:
                fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                owner = self._owner(session_id)
                if owner is not None and owner[1] != self.socket_path and self._owner_alive(owner):
                    return False
                try:  # left by an instance that is gone (or by this one): take it over
                    f.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as out:
                out.write(mine)
            return True
        return False

    def release(self, session_id: str) -> None:
        owner = self._owner(session_id)
        if owner is not None and owner[1] == self.socket_path:
            try:
                self._file(session_id).unlink()
            except FileNotFoundError:
                pass

    # ---- relaying ----------------------------------------------------------------------------
    def relay(self, session_id: str, event: str, text: str) -> dict | None:
        """Text for a session another instance holds: that instance's answer (or its S2Error raised here); None
        when no live instance holds it."""
        owner = self._owner(session_id)
        if owner is None or owner[1] == self.socket_path:
            return None
        msg = json.dumps({"key": owner[2], "session_id": session_id, "event": event, "text": text}).encode() + b"\n"
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(self.timeout_s)
                s.connect(owner[1])
                s.sendall(msg)
                reply = _read_line(s)
            if not reply:
                raise ConnectionError("it closed the connection without an answer")
        except OSError as e:
            if not _alive(owner[0]):  # its owner is gone: so is the session
                return None
            raise S2Error("unavailable", f"text session {session_id!r} is held by another {self.name} instance that "
                          f"did not answer ({e}); retry") from None
        self.relayed += 1
        out = json.loads(reply)
        if "error" in out:  # the owner's error in its wire form
            raise errors.parse(out["error"])
        return out["ok"]

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    return
                raise
            with conn:
                try:
                    conn.settimeout(self.timeout_s)
                    line = _read_line(conn)
                    if not line:  # a check that this instance is alive (`claim`): nothing to answer
                        continue
                    req = json.loads(line)
                    if not hmac.compare_digest(str(req.get("key", "")), self.key):
                        raise ValueError("a message without this instance's key")
                    try:
                        out = {"ok": self.answer(req["session_id"], req["event"], req["text"])}
                    except S2Error as e:
                        out = {"error": e.wire()}
                    self.served += 1
                    conn.sendall(json.dumps(out).encode() + b"\n")
                except (OSError, ValueError, KeyError) as e:  # a broken sender: its own call fails, this goes on
                    log.info("%s: a relayed session request failed (%s)", self.name, e)

    def close(self) -> None:
        """Stop answering; the sessions this instance held are released (they end with it)."""
        self._stop.set()
        try:
            self._server.close()
        finally:
            self._thread.join(timeout=2)
            for f in (self.dir / "sessions").glob("*"):
                owner = _read_owner(f)
                if owner is not None and owner[1] == self.socket_path:
                    f.unlink(missing_ok=True)


def _read_owner(f: Path) -> tuple[int, str, str] | None:
    """A session file's (pid, socket, key); None when it is missing or unreadable."""
    try:
        pid, path, key = f.read_text().split("\n")
        return int(pid), path, key
    except (OSError, ValueError):
        return None


def _read_line(s: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        part = s.recv(65536)
        if not part:
            if not buf:
                return b""
            raise ConnectionError("the other side closed the connection before a whole message")
        buf += part
        if len(buf) > MAX_MESSAGE:
            raise ValueError(f"a relayed message over {MAX_MESSAGE} bytes")
    return bytes(buf)
