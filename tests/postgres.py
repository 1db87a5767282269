"""A real PostgreSQL server for tests, from Debian's `postgresql` package: a fresh cluster in a temporary
directory on a free port (TCP on 127.0.0.1, trust authentication), stopped and removed on exit. As root the
server runs as the `postgres` user (initdb refuses root)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager

from s2tts.server import free_port


def find_bin() -> str | None:
    """Debian's PostgreSQL binaries (the newest version installed), or None."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(d.split("/")[-2]))
    return dirs[-1] if dirs and os.path.exists(f"{dirs[-1]}/initdb") else None


class PostgresServer:
    def __init__(self, bindir: str, root: str, port: int, as_user: list[str]):
        self.bindir, self.root, self.port, self.as_user = bindir, root, port, as_user
        self.proc: subprocess.Popen | None = None
        self._dbs = 0

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.as_user, f"{self.bindir}/{cmd[0]}", *cmd[1:]], capture_output=True, text=True,
                              timeout=120, check=check, cwd=self.root)

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://s2tts@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A new empty database; its URL."""
        self._dbs += 1
        name = f"voices{self._dbs}"
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "s2tts", name)
        return self.url(name)

    def start(self) -> None:
        self.proc = subprocess.Popen([*self.as_user, f"{self.bindir}/postgres", "-D", f"{self.root}/data", "-p",
                                      str(self.port), "-h", "127.0.0.1", "-k", self.root, "-c", "fsync=off"],
                                     stdout=open(f"{self.root}/postgres.log", "ab"), stderr=subprocess.STDOUT,
                                     cwd=self.root)
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {open(f'{self.root}/postgres.log').read()[-2000:]}")
            if self.run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError("postgres did not become ready in 60 s")

    def stop(self) -> None:
        """A fast shutdown (clients disconnected); the data stays for `start` again."""
        if self.proc is not None and self.proc.poll() is None:
            # PostgreSQL's fast shutdown (SIGTERM waits for every client), sent to the postmaster itself: `runuser`
            # (as root) does not pass SIGINT on, and the stop then waited 30 s for nothing
            try:
                with open(f"{self.root}/data/postmaster.pid") as f:
                    os.kill(int(f.readline()), signal.SIGINT)
            except (OSError, ValueError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def postgres_server():
    bindir = find_bin()
    if bindir is None:
        raise RuntimeError("Debian's postgresql package is not installed (apt-get install postgresql)")
    root = tempfile.mkdtemp(prefix="s2tts-pg-")
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    server = PostgresServer(bindir, root, free_port(), as_user)
    try:
        server.run("initdb", "-D", f"{root}/data", "-U", "s2tts", "-A", "trust", "--no-sync")
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
