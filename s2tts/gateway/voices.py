"""Registered voices, stored durably in SQLite: name, transcript, the uploaded audio and its codes."""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from dataclasses import dataclass

import numpy as np

from .errors import APIError, bad_request

# Letters, digits, '_', '-', '.'; starts with a letter or digit; no '..'; at most 64 characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESERVED = {"default", "none"}


def validate_name(name: str | None, param: str = "name") -> str:
    if name is None or not isinstance(name, str) or not name.strip():
        raise bad_request("a voice name is required", param)
    if not _NAME.match(name) or ".." in name:
        raise bad_request(f"invalid voice name {name!r}: use 1-64 letters, digits, '_', '-' or '.', "
                          "starting with a letter or digit (no '/', '\\', '..' or spaces)", param, code="invalid_voice_name")
    if name.lower() in RESERVED:
        raise bad_request(f"voice name {name!r} is reserved (it means 'no reference voice'); choose another name",
                          param, code="invalid_voice_name")
    return name


@dataclass
class Voice:
    name: str
    ref_text: str
    created_at: float
    sample_rate: int
    num_samples: int
    audio_bytes: int
    audio_mime: str
    num_codebooks: int
    frames: int
    codes: np.ndarray | None = None  # int32 [num_codebooks, frames], loaded on demand

    def public(self) -> dict:
        return {
            "id": self.name,
            "object": "audio.voice",
            "type": "audio_sample",
            "name": self.name,
            "created_at": int(self.created_at),
            "ref_text": self.ref_text,
            "duration_s": round(self.num_samples / self.sample_rate, 3) if self.sample_rate else 0.0,
            "sample_rate": self.sample_rate,
            "audio_bytes": self.audio_bytes,
            "audio_mime": self.audio_mime,
            "codes_shape": [self.num_codebooks, self.frames],
        }


_SCHEMA = """
CREATE TABLE IF NOT EXISTS voices (
    name TEXT PRIMARY KEY,
    ref_text TEXT NOT NULL,
    created_at REAL NOT NULL,
    audio BLOB NOT NULL,
    audio_mime TEXT NOT NULL,
    sample_rate INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    codes BLOB NOT NULL,
    num_codebooks INTEGER NOT NULL,
    frames INTEGER NOT NULL,
    consent TEXT
)
"""

_META = "name, ref_text, created_at, sample_rate, num_samples, length(audio), audio_mime, num_codebooks, frames"


class VoiceStore:
    """SQLite in WAL mode with synchronous=FULL: a voice is on disk once `add` returns.

    Calls are short and serialised by one lock; the gateway runs them in a worker thread.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _row(row, codes_blob=None) -> Voice:
        v = Voice(name=row[0], ref_text=row[1], created_at=row[2], sample_rate=row[3], num_samples=row[4],
                  audio_bytes=row[5], audio_mime=row[6], num_codebooks=row[7], frames=row[8])
        if codes_blob is not None:
            v.codes = np.frombuffer(codes_blob, dtype="<i4").reshape(v.num_codebooks, v.frames).astype(np.int32)
        return v

    def add(self, name: str, ref_text: str, audio: bytes, audio_mime: str, sample_rate: int, num_samples: int,
            codes: np.ndarray, consent: str | None = None) -> Voice:
        codes = np.ascontiguousarray(codes, dtype="<i4")
        if codes.ndim != 2:
            raise ValueError(f"codes must be [num_codebooks, frames], got {codes.shape}")
        now = time.time()
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO voices (name, ref_text, created_at, audio, audio_mime, sample_rate, num_samples,"
                    " codes, num_codebooks, frames, consent) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                    (name, ref_text, now, sqlite3.Binary(audio), audio_mime, int(sample_rate), int(num_samples),
                     sqlite3.Binary(codes.tobytes()), int(codes.shape[0]), int(codes.shape[1]), consent))
            except sqlite3.IntegrityError:
                raise APIError(409, f"a voice named {name!r} already exists: delete it first "
                               f"(DELETE /v1/audio/voices/{name}) or choose another name",
                               param="name", code="voice_exists") from None
        return Voice(name, ref_text, now, int(sample_rate), int(num_samples), len(audio), audio_mime,
                     int(codes.shape[0]), int(codes.shape[1]), codes.astype(np.int32))

    def get(self, name: str, with_codes: bool = True) -> Voice | None:
        cols = _META + (", codes" if with_codes else "")
        with self._lock:
            row = self._db.execute(f"SELECT {cols} FROM voices WHERE name = ?", (name,)).fetchone()
        if row is None:
            return None
        return self._row(row, row[9] if with_codes else None)

    def get_audio(self, name: str) -> tuple[bytes, str] | None:
        with self._lock:
            row = self._db.execute("SELECT audio, audio_mime FROM voices WHERE name = ?", (name,)).fetchone()
        return (bytes(row[0]), row[1]) if row else None

    def list(self) -> list[Voice]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_META} FROM voices ORDER BY created_at, name").fetchall()
        return [self._row(r) for r in rows]

    def delete(self, name: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM voices WHERE name = ?", (name,))
        return cur.rowcount > 0
