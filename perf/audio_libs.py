#!/usr/bin/env python3
"""The product's resampler and time-stretch beside the libraries that could do their job: quality against an exact
reference, speed, and (for the time-stretch, which streams) whether the chunking changes the samples.

    .venv/bin/python perf/audio_libs.py --json audio_libs.json --markdown audio_libs.md

Resampling (`prepare_audio`'s step: a voice reference at any rate -> the codec's 44.1 kHz): `s2tts`
(s2tts.codec.audio.resample), `soxr_hq` / `soxr_vhq` (python-soxr, one shot), `swr` (libswresample through PyAV's
`AudioResampler`, its default filter). The signals are band-limited by construction (a sum of sines, a chirp and a
voice-like harmonic glide under 0.9 x the lower Nyquist), so the exact output is the signal evaluated at the output's
times: `snr_*_db` is against that, over the middle (50 ms off each end). What should vanish and did not, in dB of the
input's level: `alias_db` (down-sampling), tones between the output's and the input's Nyquist; `image_db`
(up-sampling), what white noise leaves above 1.05 x the input's Nyquist. `passband_db` is the gain of a tone at 0.9 x
the lower Nyquist; `len_err` is the output's length minus ceil(T x new / orig); `noise_snr_vs_s2tts_db` compares white
noise resampled by each with the product's (inf for the product itself); `ms` is the median time for `--seconds` of
audio.

Time-stretch (the Fish API's `prosody.speed`): `s2tts` (s2tts.gateway.tempo.TimeStretch) and `atempo` (FFmpeg's filter
through PyAV's filter graph, chained 0.5 x 0.5 for 0.25; `atempo_exact`: the same, its end made as the product's is,
silence pushed at the flush and the output cut at round(T / speed)), each fed through push/flush. The voice-like glide
stretched ideally is known (the same harmonics at the warped time, each frequency kept): `lsd_db` is the log-spectral
distance between each output's spectrogram and the ideal's (lower is better); on a 220 Hz tone `pitch_err_hz` (the
middle's spectral peak off 220), `level` (RMS out / in) and `click` (largest sample step out / in); `len_err` is the
length minus round(T / speed); `chunk_diff` is the largest difference between white noise (0.5, 1 and 2 s, and
`--seconds`) pushed whole and pushed in `--chunkings` random chunkings (pieces of 1 to 4000 samples, single samples for
the first 500; inf when a length differs); `ms_per_s` is the median time per second of input. Prints one JSON line
(also into `--json`); `--markdown` writes the summary tables (each implementation's worst case over the pairs or
speeds).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "perf"))


PAIRS = ((48000, 44100), (16000, 44100), (22050, 44100), (96000, 44100), (44100, 24000))
SPEEDS = (0.25, 0.5, 0.8, 1.5, 2.0, 4.0)
SR = 44100


# --------------------------------------------------------------------------- signals (functions of time in seconds)


def sines(rng, fmax):
    f = rng.uniform(50, fmax, 8)
    a, p = rng.uniform(0.02, 0.1, 8), rng.uniform(0, 2 * np.pi, 8)
    return lambda t: (a[:, None] * np.sin(2 * np.pi * f[:, None] * t[None] + p[:, None])).sum(0)


def chirp(seconds, fmax):
    f0, f1 = 50.0, fmax
    return lambda t: 0.4 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * seconds)))


def voice(fmax, speed=1.0):
    """A hummed voice: f0 gliding 100..220 Hz, harmonics under `fmax` shaped by three formants, syllables at 4 Hz.
    With `speed`, the ideal time-stretch of it: the same at time t x speed, every frequency kept."""
    f0_mean, f0_dev, rate = 160.0, 60.0, 0.7

    def phase(t):  # 2 pi x integral of f0
        return 2 * np.pi * (f0_mean * t - f0_dev / (2 * np.pi * rate) * np.cos(2 * np.pi * rate * t))

    def f(t):
        u = t * speed  # the input's time
        f0 = f0_mean + f0_dev * np.sin(2 * np.pi * rate * u)
        ph = phase(u) / speed
        env = 0.5 * (1 - np.cos(2 * np.pi * 4 * u)) ** 2 / 4
        y = np.zeros_like(t)
        for k in range(1, int(fmax // (f0_mean + f0_dev)) + 1):
            fk = k * f0
            gain = sum(np.exp(-((fk - fm) / bw) ** 2) for fm, bw in ((700, 150), (1200, 200), (2600, 400)))
            y += (0.05 + gain) / k * np.sin(k * ph)
        return 0.25 * env * y

    return f


# --------------------------------------------------------------------------- resamplers: float32 [T] -> float32 [T']


def resample_s2tts(x, orig, new):
    import torch

    from s2tts.codec.audio import resample

    return resample(torch.from_numpy(x), orig, new).numpy()


def resample_soxr(quality):
    def run(x, orig, new):
        import soxr

        return soxr.resample(x, orig, new, quality=quality).astype(np.float32, copy=False)

    return run


def resample_swr(x, orig, new):
    import av

    r = av.AudioResampler(format="flt", layout="mono", rate=new)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None]), format="flt", layout="mono")
    frame.sample_rate, frame.pts = orig, 0
    out = [f.to_ndarray().reshape(-1) for f in [*r.resample(frame), *r.resample(None)]]
    return np.concatenate(out).astype(np.float32, copy=False)


RESAMPLERS = {"s2tts": resample_s2tts, "soxr_hq": resample_soxr("HQ"), "soxr_vhq": resample_soxr("VHQ"),
              "swr": resample_swr}


def snr_db(y, ref):
    err = np.sum((y - ref) ** 2)
    return float("inf") if err == 0 else float(10 * np.log10(np.sum(ref ** 2) / err))


def db(ratio):
    return float(20 * np.log10(max(ratio, 1e-12)))


def rms(x):
    return float(np.sqrt(np.mean(np.asarray(x, np.float64) ** 2)))


def median_ms(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def measure_resampling(seconds, repeats, seed):
    rows = []
    for orig, new in PAIRS:
        rng = np.random.default_rng(seed)
        t_in = np.arange(int(seconds * orig) + 7) / orig  # 7: a length whose ceil and round differ for most pairs
        n_out = -(-len(t_in) * new // orig)
        t_out = np.arange(n_out) / new
        lo_nyq = min(orig, new) / 2
        edge = int(0.05 * new)
        mid = slice(edge, n_out - edge)
        band = {"sines": sines(rng, 0.9 * lo_nyq), "chirp": chirp(seconds, 0.9 * lo_nyq), "voice": voice(0.9 * lo_nyq)}
        inputs = {k: f(t_in).astype(np.float32) for k, f in band.items()}
        exact = {k: f(t_out) for k, f in band.items()}
        noise = (0.1 * rng.standard_normal(len(t_in))).astype(np.float32)
        tone = lambda hz, t: (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)  # noqa: E731
        if new < orig:  # what lies between the two Nyquists must vanish
            stop_in = sum(tone(hz, t_in) for hz in np.linspace(1.05 * new / 2, 0.95 * orig / 2, 5)) / 5
        pass_hz = 0.9 * lo_nyq
        noise_ref = RESAMPLERS["s2tts"](noise, orig, new)
        for name, fn in RESAMPLERS.items():
            row = {"pair": f"{orig}->{new}", "impl": name}
            outs = {k: fn(x, orig, new) for k, x in inputs.items()}
            row["len_err"] = len(outs["voice"]) - n_out
            for k, y in outs.items():
                m = min(len(y), n_out)
                row[f"snr_{k}_db"] = snr_db(y[:m][mid], exact[k][:m][mid])
            if new < orig:
                row["alias_db"] = db(rms(fn(stop_in, orig, new)[mid]) / rms(stop_in))
            else:
                y = fn(noise, orig, new)
                spec = np.abs(np.fft.rfft(y[mid])) ** 2
                hz = np.fft.rfftfreq(len(y[mid]), 1 / new)
                row["image_db"] = float(10 * np.log10(max(spec[hz > 1.05 * orig / 2].sum() / spec.sum(), 1e-24)))
            y = fn(tone(pass_hz, t_in), orig, new)
            row["passband_db"] = db(rms(y[mid]) / rms(tone(pass_hz, t_out)[mid]))
            y = fn(noise, orig, new)
            m = min(len(y), len(noise_ref))
            row["noise_snr_vs_s2tts_db"] = snr_db(y[:m][mid], noise_ref[:m][mid])
            x = inputs["voice"]
            row["ms"] = median_ms(lambda: fn(x, orig, new), repeats)  # noqa: B023 - called at once
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- time-stretch: push/flush streams


class Atempo:
    """FFmpeg's atempo through PyAV's filter graph, fed float32 mono; `atempo` takes 0.5..100, so 0.25 is 0.5 x 0.5.
    A frame of fewer than speed / 2 samples makes atempo fail (ENOMEM: its output buffer would be 0 samples long), so
    pieces shorter than `speed` samples wait for the next."""

    def __init__(self, speed, sample_rate=SR):
        import av

        self._av, self.sample_rate, self._pts = av, sample_rate, 0
        self._min, self._held = math.ceil(speed), np.zeros(0, np.float32)
        g = av.filter.Graph()
        nodes = [g.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono", time_base=f"1/{sample_rate}")]
        factors, s = [], speed
        while s < 0.5:
            factors.append(0.5)
            s /= 0.5
        for f in [*factors, s]:
            nodes.append(g.add("atempo", f"{f:.10g}"))
        nodes.append(g.add("abuffersink"))
        for a, b in zip(nodes, nodes[1:]):
            a.link_to(b)
        g.configure()
        self._graph, self._src, self._sink = g, nodes[0], nodes[-1]  # the nodes live as long as their graph

    def _pull(self):
        out = []
        while True:
            try:
                out.append(self._sink.pull().to_ndarray().reshape(-1))
            except (self._av.BlockingIOError, self._av.EOFError):
                break
        return np.concatenate(out).astype(np.float32, copy=False) if out else np.zeros(0, np.float32)

    def push(self, x):
        x = np.concatenate([self._held, np.asarray(x, np.float32).reshape(-1)])
        if len(x) < self._min:
            self._held = x
            return np.zeros(0, np.float32)
        self._held = np.zeros(0, np.float32)
        return self._feed(x)

    def _feed(self, x):
        x = np.ascontiguousarray(x.reshape(1, -1))
        frame = self._av.AudioFrame.from_ndarray(x, format="flt", layout="mono")
        frame.sample_rate, frame.pts = self.sample_rate, self._pts
        self._pts += x.shape[1]
        self._src.push(frame)
        return self._pull()

    def flush(self):
        tail = np.zeros(0, np.float32)
        if len(self._held):  # a short tail, with some silence
            tail = self._feed(np.concatenate([self._held, np.zeros(self._min, np.float32)]))
        self._src.push(None)
        return np.concatenate([tail, self._pull()])


class AtempoExact(Atempo):
    """Atempo made to end as the product's stretch does: at the flush, silence until the output reaches
    round(T / speed), then cut there (what atempo gives at its own end of stream depends on the chunking)."""

    def __init__(self, speed, sample_rate=SR):
        super().__init__(speed, sample_rate)
        self.speed, self._in, self._out = speed, 0, 0

    def push(self, x):
        self._in += len(np.asarray(x).reshape(-1))
        y = super().push(x)
        self._out += len(y)
        return y

    def flush(self):
        target, out = round(self._in / self.speed), []
        while self._out < target:
            y = super().push(np.zeros(4096, np.float32))
            self._out += len(y)
            out.append(y)
        y = np.concatenate(out) if out else np.zeros(0, np.float32)
        return y[:len(y) - (self._out - target)] if self._out > target else y


def stretch_s2tts(speed):
    from s2tts.gateway.tempo import TimeStretch

    return TimeStretch(speed, SR)


STRETCHERS = {"s2tts": stretch_s2tts, "atempo": Atempo, "atempo_exact": AtempoExact}


def stretch(make, speed, x, cuts=None):
    ts = make(speed)
    if cuts is None:
        return np.concatenate([ts.push(x), ts.flush()])
    return np.concatenate([ts.push(x[a:b]) for a, b in zip(cuts, cuts[1:])] + [ts.flush()])


def random_cuts(n, rng):
    cuts = list(range(0, min(n, 500)))  # single samples first
    while cuts[-1] < n:
        cuts.append(min(n, cuts[-1] + int(rng.integers(1, 4000))))
    return cuts


def log_spectrogram(y, n_fft=2048, hop=512):
    frames = np.lib.stride_tricks.sliding_window_view(np.asarray(y, np.float64), n_fft)[::hop]
    power = np.abs(np.fft.rfft(frames * np.hanning(n_fft), axis=1)) ** 2
    return 10 * np.log10(power + 1e-10)


def lsd_db(y, ideal, sr=SR, max_hz=8000):
    n = min(len(y), len(ideal))
    a, b = log_spectrogram(y[:n]), log_spectrogram(ideal[:n])
    bins = np.fft.rfftfreq(2048, 1 / sr) <= max_hz
    loud = b[:, bins].max(axis=1) > b[:, bins].max() - 40  # frames where the ideal is not silent
    d = (a[loud][:, bins] - b[loud][:, bins]) ** 2
    return float(np.mean(np.sqrt(d.mean(axis=1))))


def peak_hz(x, sr=SR):
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.argmax(spec) * sr / len(x))


def measure_time_stretch(seconds, repeats, seed, chunkings):
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    t = np.arange(n) / SR
    x_voice = voice(0.9 * SR / 2)(t).astype(np.float32)
    x_tone = (0.5 * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    # short answers too: how atempo ends depends on the chunking more often for them
    noises = [(0.1 * rng.standard_normal(int(s * SR))).astype(np.float32) for s in (0.5, 1, 2) if s < seconds]
    noises.append((0.1 * rng.standard_normal(n)).astype(np.float32))
    cuts = [[random_cuts(len(x), rng) for _ in range(chunkings)] for x in noises]
    rows = []
    for speed in SPEEDS:
        target = round(n / speed)
        ideal = voice(0.9 * SR / 2, speed)(np.arange(target) / SR)
        for name, make in STRETCHERS.items():
            row = {"speed": speed, "impl": name}
            y = stretch(make, speed, x_voice)
            row["len_err"] = len(y) - target
            row["lsd_db"] = lsd_db(y, ideal)
            y = stretch(make, speed, x_tone)
            mid = y[len(y) // 4: 3 * len(y) // 4]
            row["pitch_err_hz"] = abs(peak_hz(mid) - 220.0)
            row["level"] = rms(mid) / rms(x_tone)
            row["click"] = float(np.abs(np.diff(mid)).max() / np.abs(np.diff(x_tone)).max())
            diffs = []
            for x, chunkings_of_x in zip(noises, cuts):
                whole = stretch(make, speed, x)
                for c in chunkings_of_x:
                    pieces = stretch(make, speed, x, c)
                    diffs.append(float(np.abs(whole - pieces).max()) if len(whole) == len(pieces) else float("inf"))
            row["chunk_diff"] = max(diffs)
            row["ms_per_s"] = median_ms(lambda: stretch(make, speed, x_voice), repeats) / seconds  # noqa: B023
            rows.append(row)
    return rows


def markdown(rep) -> str:
    """The report in two tables, one row an implementation: its worst case over the pairs (speeds) and signals."""
    def worst(rows, key, pick):
        return pick(r[key] for r in rows)

    lines = ["| resampler | min SNR vs exact (dB) | aliasing (dB) | imaging (dB) | passband at 0.9 Nyquist (dB) | "
             "length error (samples) | time (x s2tts) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = rep["resample"]
    base = sum(r["ms"] for r in rows if r["impl"] == "s2tts")
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        snr = min(r[k] for r in mine for k in r if k.startswith("snr_"))
        lens = sorted({r["len_err"] for r in mine})
        down, up = [r for r in mine if "alias_db" in r], [r for r in mine if "image_db" in r]
        lines.append(f"| {impl} | {snr:.1f} | {worst(down, 'alias_db', max):.1f} | {worst(up, 'image_db', max):.1f} | "
                     f"{worst(mine, 'passband_db', min):.2f} | {', '.join(map(str, lens))} | "
                     f"{sum(r['ms'] for r in mine) / base:.2f} |")
    lines += ["", "| time-stretch | mean LSD vs ideal (dB) | worst LSD | max pitch error (Hz) | level | max click | "
              "length error (samples) | chunk difference | time (x s2tts) |", "| --- " * 9 + "|"]
    rows = rep["time_stretch"]
    base = sum(r["ms_per_s"] for r in rows if r["impl"] == "s2tts")
    for impl in dict.fromkeys(r["impl"] for r in rows):
        mine = [r for r in rows if r["impl"] == impl]
        lens = (worst(mine, "len_err", min), worst(mine, "len_err", max))
        level = f"{worst(mine, 'level', min):.3f}..{worst(mine, 'level', max):.3f}"
        lsd = f"{statistics.mean(r['lsd_db'] for r in mine):.2f} | {worst(mine, 'lsd_db', max):.2f}"
        lines.append(f"| {impl} | {lsd} | "
                     f"{worst(mine, 'pitch_err_hz', max):.2f} | {level} | {worst(mine, 'click', max):.3f} | "
                     f"{lens[0]}..{lens[1]} | {worst(mine, 'chunk_diff', max):.3g} | "
                     f"{sum(r['ms_per_s'] for r in mine) / base:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="length of every test signal")
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each (the median is reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunkings", type=int, default=8, help="random chunkings each time-stretch is pushed in")
    ap.add_argument("--threads", type=int, default=1, help="torch's compute threads (a model process's are one)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None, help="also write the two summary tables (perf/AUDIO_LIBS.md's) here")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    rep = {"seconds": a.seconds, "repeats": a.repeats, "threads": a.threads, "chunkings": a.chunkings,
           "resample": measure_resampling(a.seconds, a.repeats, a.seed),
           "time_stretch": measure_time_stretch(a.seconds, a.repeats, a.seed, a.chunkings)}
    if a.markdown:
        Path(a.markdown).write_text(markdown(rep))
    line = json.dumps(rep)
    print(line)
    if a.json:
        Path(a.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
