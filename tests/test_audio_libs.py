"""perf/audio_libs.py, small: the product's resampler and time-stretch beside the libraries (perf/AUDIO_LIBS.md).
Its numbers are real: an implementation beside itself differs by nothing, a known-good library meets the exact
reference, and the product keeps its contract (length, chunk invariance)."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))

pytest.importorskip("av")
pytest.importorskip("soxr")
import audio_libs  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("audio_libs")
    p = subprocess.run([sys.executable, str(ROOT / "perf" / "audio_libs.py"), "--seconds", "0.5", "--repeats", "1",
                        "--chunkings", "2", "--json", str(out / "r.json"), "--markdown", str(out / "r.md")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    rep = json.loads((out / "r.json").read_text())
    assert json.loads(p.stdout.strip().splitlines()[-1]) == rep
    return rep, (out / "r.md").read_text()


def test_resampling_report(report):
    rep, md = report
    rows = {(r["pair"], r["impl"]): r for r in rep["resample"]}
    assert set(rows) == {(f"{a}->{b}", i) for a, b in audio_libs.PAIRS for i in audio_libs.RESAMPLERS}
    for (pair, impl), r in rows.items():
        orig, new = map(int, pair.split("->"))
        assert ("alias_db" in r) == (new < orig) and ("image_db" in r) == (new > orig), r
        assert r["ms"] > 0 and abs(r["passband_db"]) < 3, r
        # the product's own output beside itself: no difference; another library's: some
        if impl == "s2tts":
            assert r["noise_snr_vs_s2tts_db"] == math.inf, r
        if impl == "swr":
            assert 5 < r["noise_snr_vs_s2tts_db"] < 60, r
        if impl == "s2tts":  # the product's length contract: ceil(T x new / orig)
            assert r["len_err"] == 0, r
        assert abs(r["len_err"]) <= 1, r
        if impl == "soxr_vhq":  # a 28-bit library against the exact signal: the reference is exact and aligned
            assert min(r["snr_sines_db"], r["snr_voice_db"]) > 85 and r["snr_chirp_db"] > 70, r
            assert r.get("alias_db", -200) < -120, r
        assert min(r["snr_sines_db"], r["snr_voice_db"]) > 55, r
    tables = [[[c.strip() for c in line.strip("|").split("|")] for line in block.splitlines()]
              for block in md.strip().split("\n\n")]
    assert [[row[0] for row in t[2:]] for t in tables] == [list(audio_libs.RESAMPLERS), list(audio_libs.STRETCHERS)]
    assert all(len(row) == len(t[0]) for t in tables for row in t), md


def test_time_stretch_report(report):
    rep, _ = report
    rows = {(r["speed"], r["impl"]): r for r in rep["time_stretch"]}
    assert set(rows) == {(s, i) for s in audio_libs.SPEEDS for i in audio_libs.STRETCHERS}
    for (speed, impl), r in rows.items():
        assert 0 < r["lsd_db"] < 20 and r["ms_per_s"] > 0 and 0.7 < r["level"] < 1.3 and r["click"] < 1.5, r
        if impl != "atempo":  # the product's stretch and atempo made to end as it does: exact length, any chunking
            assert r["len_err"] == 0 and r["chunk_diff"] == 0, r
            assert r["pitch_err_hz"] < 5, r


def test_the_measures_themselves():
    """Each measure is zero (or infinite) for a signal beside itself and grows with a real difference."""
    t = np.arange(44100) / 44100
    ideal = audio_libs.voice(0.9 * 22050, 2.0)(t)
    assert audio_libs.snr_db(ideal, ideal) == math.inf and audio_libs.lsd_db(ideal, ideal) == 0
    shifted = audio_libs.voice(0.9 * 22050, 2.0)(t * 1.06)  # 6 % higher: the pitch is not kept
    assert audio_libs.lsd_db(shifted, ideal) > 3
    assert 20 < audio_libs.snr_db(ideal + 0.01 * np.abs(ideal).max(), ideal) < 60
    cuts = audio_libs.random_cuts(10000, np.random.default_rng(0))
    assert cuts[:500] == list(range(500)) and cuts[-1] == 10000 and all(b > a for a, b in zip(cuts, cuts[1:]))
    # atempo made exact: the length asked for; for speeds above 2 single samples are held, not fed (FFmpeg fails)
    x = np.random.default_rng(1).standard_normal(5000).astype(np.float32) * 0.1
    y = audio_libs.stretch(audio_libs.AtempoExact, 4.0, x, list(range(0, 100)) + [5000])
    assert len(y) == 1250
