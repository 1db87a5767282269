"""Registered voices, stored durably: name, transcript, the uploaded audio and its codes. SQLite (one gateway, the
embedded default) or PostgreSQL (voices shared by gateway replicas); `open_store` picks by the `--db` value."""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from dataclasses import dataclass

import numpy as np

from .error_bodies import APIError, bad_request

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
    title: str | None = None  # Fish Audio's display title (`/model`); None: the name
    description: str = ""  # Fish Audio's description
    updated_at: float | None = None  # the last change (`update`, `rename`); None: never changed

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


_COLUMNS = """
    name TEXT PRIMARY KEY,
    ref_text TEXT NOT NULL,
    created_at {real} NOT NULL,
    audio {blob} NOT NULL,
    audio_mime TEXT NOT NULL,
    sample_rate INTEGER NOT NULL,
    num_samples INTEGER NOT NULL,
    codes {blob} NOT NULL,
    num_codebooks INTEGER NOT NULL,
    frames INTEGER NOT NULL,
    consent TEXT
"""

# The voice table's migrations, in order: the store's schema version is the number of them applied. Add new ones
# at the end (never edit one that has shipped); both backends run the same list.
MIGRATIONS = [
    "CREATE TABLE IF NOT EXISTS voices (" + _COLUMNS + ")",
    "ALTER TABLE voices ADD COLUMN title TEXT",
    "ALTER TABLE voices ADD COLUMN description TEXT",
    "ALTER TABLE voices ADD COLUMN updated_at {real}",
]

_META = ("name, ref_text, created_at, sample_rate, num_samples, {length}(audio), audio_mime, num_codebooks, frames, "
         "title, description, updated_at")
_CODES = 12  # the column after _META's: a voice's codes


def open_store(spec: str) -> "VoiceStore":
    """The voice store `--db` names: a `postgresql://` URL (voices shared by gateway replicas) or an SQLite file
    (the embedded default)."""
    if spec.startswith(("postgresql://", "postgres://")):
        return PostgresVoiceStore(spec)
    return VoiceStore(spec)


def _exists(name: str) -> APIError:
    return APIError(409, f"a voice named {name!r} already exists: delete it first (DELETE /v1/audio/voices/{name}) "
                    "or choose another name", param="name", code="voice_exists")


class VoiceStore:
    """SQLite in WAL mode with synchronous=FULL: a voice is on disk once `add` returns.

    Calls are short and serialised by one lock; the gateway runs them in a worker thread. The schema version is
    SQLite's `user_version`. Subclasses change the connection and the SQL dialect, nothing else.
    """

    P = "?"  # the driver's parameter placeholder
    REAL, BLOB, LENGTH = "REAL", "BLOB", "length"

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._migrate()

    # ---- the backend -------------------------------------------------------------------------
    def _migrate(self) -> None:
        with self._lock:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            self._check_version(version)
            for i in range(version, len(MIGRATIONS)):
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(self._ddl(MIGRATIONS[i]))
                self._db.execute(f"PRAGMA user_version = {i + 1}")
                self._db.execute("COMMIT")

    def _ddl(self, sql: str) -> str:
        return sql.format(real=self.REAL, blob=self.BLOB)

    def _check_version(self, version: int) -> None:
        if version > len(MIGRATIONS):
            raise RuntimeError(f"voice store {self.describe()} has schema version {version}, newer than this gateway's "
                               f"{len(MIGRATIONS)}: upgrade the gateway (s2tts) to use it")

    def describe(self) -> str:
        return self.path

    def _execute(self, sql: str, args=()) -> list:
        """Run one statement; its rows (if any) and the number of rows it changed."""
        with self._lock:
            cur = self._db.execute(sql.replace("%s", self.P), args)
            return cur.fetchall(), cur.rowcount

    def _is_duplicate(self, e: Exception) -> bool:
        return isinstance(e, sqlite3.IntegrityError)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- voices ------------------------------------------------------------------------------
    @property
    def _meta(self) -> str:
        return _META.format(length=self.LENGTH)

    @staticmethod
    def _row(row, codes_blob=None) -> Voice:
        v = Voice(name=row[0], ref_text=row[1], created_at=float(row[2]), sample_rate=row[3], num_samples=row[4],
                  audio_bytes=row[5], audio_mime=row[6], num_codebooks=row[7], frames=row[8], title=row[9],
                  description=row[10] or "", updated_at=None if row[11] is None else float(row[11]))
        if codes_blob is not None:
            v.codes = np.frombuffer(bytes(codes_blob), dtype="<i4").reshape(v.num_codebooks, v.frames).astype(np.int32)
        return v

    @staticmethod
    def _clip(audio: bytes, audio_mime: str, sample_rate: int, num_samples: int, codes: np.ndarray) -> dict:
        """A clip's columns: the file, its decoded length and its codes [num_codebooks, frames]."""
        codes = np.ascontiguousarray(codes, dtype="<i4")
        if codes.ndim != 2:
            raise ValueError(f"codes must be [num_codebooks, frames], got {codes.shape}")
        return {"audio": bytes(audio), "audio_mime": audio_mime, "sample_rate": int(sample_rate),
                "num_samples": int(num_samples), "codes": codes.tobytes(), "num_codebooks": int(codes.shape[0]),
                "frames": int(codes.shape[1])}

    def add(self, name: str, ref_text: str, audio: bytes, audio_mime: str, sample_rate: int, num_samples: int,
            codes: np.ndarray, consent: str | None = None, title: str | None = None, description: str = "") -> Voice:
        clip = self._clip(audio, audio_mime, sample_rate, num_samples, codes)
        cols = {"name": name, "ref_text": ref_text, "created_at": time.time(), **clip, "consent": consent,
                "title": title, "description": description}
        try:
            self._execute(f"INSERT INTO voices ({', '.join(cols)}) VALUES ({', '.join(['%s'] * len(cols))})",
                          tuple(cols.values()))
        except Exception as e:
            if self._is_duplicate(e):
                raise _exists(name) from None
            raise
        return Voice(name, ref_text, cols["created_at"], clip["sample_rate"], clip["num_samples"], len(audio),
                     audio_mime, clip["num_codebooks"], clip["frames"], np.asarray(codes, np.int32), title,
                     description)

    def update(self, name: str, *, title: str | None = None, description: str | None = None,
               ref_text: str | None = None, clip: tuple | None = None) -> bool:
        """Change what is given of a voice: its title, description, transcript, or its clip (`clip`: audio,
        audio_mime, sample_rate, num_samples, codes, as `add` takes them). -> whether the voice exists."""
        cols = {k: v for k, v in (("title", title), ("description", description), ("ref_text", ref_text))
                if v is not None}
        if clip is not None:
            cols.update(self._clip(*clip))
        cols["updated_at"] = time.time()
        _, n = self._execute(f"UPDATE voices SET {', '.join(f'{k} = %s' for k in cols)} WHERE name = %s",
                             (*cols.values(), name))
        return n > 0

    def rename(self, name: str, new_name: str) -> bool:
        """The voice `name` from now on called `new_name` (409 if that name is taken). -> whether it existed."""
        try:
            _, n = self._execute("UPDATE voices SET name = %s, updated_at = %s WHERE name = %s",
                                 (new_name, time.time(), name))
        except Exception as e:
            if self._is_duplicate(e):
                raise _exists(new_name) from None
            raise
        return n > 0

    def get(self, name: str, with_codes: bool = True) -> Voice | None:
        cols = self._meta + (", codes" if with_codes else "")
        rows, _ = self._execute(f"SELECT {cols} FROM voices WHERE name = %s", (name,))
        if not rows:
            return None
        return self._row(rows[0], rows[0][_CODES] if with_codes else None)

    def get_audio(self, name: str) -> tuple[bytes, str] | None:
        rows, _ = self._execute("SELECT audio, audio_mime FROM voices WHERE name = %s", (name,))
        return (bytes(rows[0][0]), rows[0][1]) if rows else None

    def list(self) -> list[Voice]:
        rows, _ = self._execute(f"SELECT {self._meta} FROM voices ORDER BY created_at, name")
        return [self._row(r) for r in rows]

    def delete(self, name: str) -> bool:
        _, n = self._execute("DELETE FROM voices WHERE name = %s", (name,))
        return n > 0


class PostgresVoiceStore(VoiceStore):
    """The same store in PostgreSQL, shared by every gateway replica that names the same database.

    One connection per gateway, in autocommit mode (each statement its own transaction; a voice is committed
    once `add` returns), serialised by the store's lock. A name registered by two gateways at once: the primary
    key lets exactly one in, the other gets 409. Migrations run under a transaction-scoped advisory lock, so
    replicas that start together apply each one once; the version is the row count of `s2tts_schema`.
    A lost connection (a database restart) is reopened on the next call.
    """

    P = "%s"
    REAL, BLOB, LENGTH = "DOUBLE PRECISION", "BYTEA", "octet_length"
    _LOCK_KEY = 0x5332_5454  # "S2TT": the advisory lock of this schema's migrations

    def __init__(self, url: str):
        try:
            import psycopg  # noqa: F401
        except ImportError as e:
            raise RuntimeError("a postgresql:// voice store needs psycopg: pip install 'psycopg[binary]' "
                               "(the gateway extra has it)") from e
        self.url = url
        self.path = url
        self._lock = threading.Lock()
        self._db = None
        self._connect()
        self._migrate()

    def describe(self) -> str:
        return re.sub(r"//([^:@/]+):[^@/]*@", r"//\1:***@", self.url)  # no password in messages

    def _connect(self):
        import psycopg

        try:
            self._db = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        except psycopg.OperationalError as e:
            raise RuntimeError(f"cannot reach the voice store {self.describe()}: {str(e).strip()}") from None

    def _migrate(self) -> None:
        with self._lock, self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(%s)", (self._LOCK_KEY,))
            self._db.execute("CREATE TABLE IF NOT EXISTS s2tts_schema (version INTEGER PRIMARY KEY, "
                             "applied_at DOUBLE PRECISION NOT NULL)")
            version = self._db.execute("SELECT count(*) FROM s2tts_schema").fetchone()[0]
            self._check_version(version)
            for i in range(version, len(MIGRATIONS)):
                self._db.execute(self._ddl(MIGRATIONS[i]))
                self._db.execute("INSERT INTO s2tts_schema (version, applied_at) VALUES (%s, %s)", (i + 1, time.time()))

    def _execute(self, sql: str, args=()) -> list:
        import psycopg

        with self._lock:
            for attempt in (0, 1):
                try:
                    if self._db is None or self._db.closed:
                        self._connect()
                    cur = self._db.execute(sql, args)
                    return (cur.fetchall() if cur.description else []), cur.rowcount
                except psycopg.OperationalError:
                    if attempt or not sql.lstrip().upper().startswith("SELECT"):
                        raise  # a write is not repeated blindly: it may have been applied
                    self._db = None  # reconnect once (the server restarted) and read again

    def _is_duplicate(self, e: Exception) -> bool:
        import psycopg

        return isinstance(e, psycopg.errors.UniqueViolation)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
