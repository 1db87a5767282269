"""The in-process stack sampler (`s2tts.serving.profiler`, what `S2TTS_PROFILE_DIR` turns on in every model process): it
finds where a busy thread spends its time, counts how late its own samples come while a thread holds the GIL,
writes flame-graph input and a summary, and starts from the environment once per process."""

import os
import threading
import time

from s2tts.serving import profiler as sampler


def _spin(stop):
    while not stop.is_set():
        sum(range(2000))


def _wait(stop):
    stop.wait()


def test_busy_thread_leads_and_the_files_say_so(tmp_path):
    stop = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,), name="busy-1"),
               threading.Thread(target=_wait, args=(stop,), name="idle-1")]
    for t in threads:
        t.start()
    s = sampler.StackSampler("test", tmp_path, interval_s=0.002, write_every_s=0.2).start()
    try:
        time.sleep(0.6)
    finally:
        stop.set()
        for t in threads:
            t.join()
        s.stop()
    assert s.samples > 20 and len(s.late_s) == s.samples
    folded = dict(line.rsplit(" ", 1) for line in s.folded_path.read_text().splitlines())
    busy = sum(int(n) for k, n in folded.items() if k.startswith("busy;") and "test_sampler._spin" in k)
    idle = sum(int(n) for k, n in folded.items() if k.startswith("idle;") and "test_sampler._wait" in k)
    assert busy > 0.5 * s.samples and idle > 0.5 * s.samples  # every sample sees both threads where they are
    text = s.text_path.read_text()
    assert text.startswith("test (pid ") and "sampler late (waiting for the GIL): p50" in text
    assert "test_sampler._spin" in text and "threading.wait" in text


def test_started_from_the_environment_once(tmp_path, monkeypatch):
    monkeypatch.setattr(sampler, "_started", None)
    monkeypatch.delenv(sampler.ENV, raising=False)
    assert sampler.start_from_env("m") is None
    monkeypatch.setenv(sampler.ENV, str(tmp_path / "prof"))
    monkeypatch.setenv("S2TTS_PROFILE_INTERVAL_MS", "4")
    s = sampler.start_from_env("slow_ar")
    try:
        assert s is not None and sampler.start_from_env("other") is s and s.interval_s == 0.004
        assert s.text_path == tmp_path / "prof" / f"slow_ar.{os.getpid()}.txt"
    finally:
        s.stop()
    assert s.folded_path.is_file() and s.text_path.is_file()
