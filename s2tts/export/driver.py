"""Exporting a checkpoint's graphs: `export_all` writes every graph and `manifest.json` (each graph's inputs and
outputs, its TensorRT profile shapes and trtexec arguments); `load_manifest` reads it back (the repository's
variants, build/build_engines.sh)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..ar.loading import load_model
from ..codec.loading import codec_codebook_sizes, load_codec_from_dir
from .onnx_graphs import (
    GRAPHS,
    OPSET,
    CodecDecoderGraph,
    CodecEncoderGraph,
    FastARFrame,
    export_graph,
    fast_ar_uniforms,
    state_tensor_name,
)

log = logging.getLogger("s2tts")

MANIFEST = "manifest.json"


@dataclass
class Profiles:
    """Shape ranges (min, opt, max) of the TensorRT optimisation profiles, written into the manifest.

    Frames/samples outside a profile are handled by the callers: `GraphStreamCodec` cuts a
    chunk into pieces of at most `stream_frames[2]` frames (streaming is exact, so the audio is
    the same), `dac_encoder` refuses references longer than `encoder_frames[2]` frames.
    """

    fast_ar_batch: tuple[int, int, int] = (1, 16, 64)
    stream_batch: tuple[int, int, int] = (1, 16, 64)
    stream_frames: tuple[int, int, int] = (1, 16, 32)
    decoder_batch: tuple[int, int, int] = (1, 1, 4)
    decoder_frames: tuple[int, int, int] = (1, 256, 1024)
    encoder_batch: tuple[int, int, int] = (1, 1, 4)
    encoder_frames: tuple[int, int, int] = (1, 256, 660)  # 660 frames = 30.6 s at 44.1 kHz


_TRITON_TYPES = {1: "TYPE_FP32", 6: "TYPE_INT32", 7: "TYPE_INT64", 9: "TYPE_BOOL", 10: "TYPE_FP16", 16: "TYPE_BF16", 11: "TYPE_FP64"}
_NP_TYPES = {"TYPE_FP32": np.float32, "TYPE_INT32": np.int32, "TYPE_INT64": np.int64, "TYPE_BOOL": np.bool_,
             "TYPE_FP16": np.float16, "TYPE_FP64": np.float64}


def graph_io(path: str | Path) -> dict:
    """{"inputs": [...], "outputs": [...]} of an ONNX file: name, Triton data type, dims (-1 = dynamic)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)

    def describe(values):
        out = []
        for v in values:
            t = v.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
            out.append({"name": v.name, "data_type": _TRITON_TYPES[t.elem_type], "dims": dims})
        return out

    return {"inputs": describe(model.graph.input), "outputs": describe(model.graph.output)}


def _shape_sets(io: dict, sizes: dict[str, tuple[int, int, int]], axis_names: dict[str, dict[int, str]]) -> dict[str, dict[str, list[int]]]:
    """min/opt/max concrete shapes of every input, from the named dynamic axes."""
    out = {"min": {}, "opt": {}, "max": {}}
    for inp in io["inputs"]:
        for i, which in enumerate(("min", "opt", "max")):
            shape = []
            for ax, d in enumerate(inp["dims"]):
                if d >= 0:
                    shape.append(d)
                else:
                    shape.append(sizes[axis_names[inp["name"]][ax]][i])
            out[which][inp["name"]] = shape
    return out


def _trtexec_shapes(shapes: dict[str, list[int]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(d) for d in shape)}" for name, shape in shapes.items())


def export_all(checkpoint: str | Path, out: str | Path, graphs=GRAPHS, profiles: Profiles | None = None,
               model=None, codec=None, max_positions: int = 32768) -> dict:
    """Export the graphs of a checkpoint into `out` and write `out/manifest.json`; returns the manifest.

    `model` (an S2Model with at least the fast AR) and `codec` may be given to skip loading them.
    """
    checkpoint, out = Path(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = profiles or Profiles()
    unknown = sorted(set(graphs) - set(GRAPHS))
    if unknown:
        raise ValueError(f"unknown graph(s) {unknown}: choose from {list(GRAPHS)}")
    if model is None and any(g.startswith("fast_ar") for g in graphs):
        model = load_model(checkpoint, "cpu", "fp32", parts=("fast",))
    if codec is None and any(g.startswith("dac_") for g in graphs):
        codec = load_codec_from_dir(checkpoint, "cpu", "fp32")
    residual = codec.config.codebook_size if codec is not None else codec_codebook_sizes(checkpoint)[1]
    manifest = {"checkpoint": str(checkpoint.resolve()), "opset": OPSET, "torch": torch.__version__, "graphs": {}}
    gen = torch.Generator().manual_seed(0)
    B = 2  # trace batch (not 1: a size-1 axis can be specialised away)

    if model is not None:
        s2 = model.s2
        manifest.update(num_codebooks=s2.num_codebooks, residual_size=residual, dim=s2.audio.dim)
    if codec is not None:
        manifest.update(frame_length=codec.frame_length, sample_rate=codec.sample_rate, num_codebooks=codec.config.num_codebooks)

    for name in graphs:
        t0 = time.monotonic()
        path = out / f"{name}.onnx"
        if name.startswith("fast_ar"):
            s2 = model.s2
            frame = FastARFrame(model.fast, residual, seeded=name == "fast_ar_seeded")
            n = frame.n
            args = [torch.randn(B, s2.audio.dim, generator=gen), torch.randint(0, s2.codebook_size, (B,), generator=gen, dtype=torch.int32),
                    torch.full((B,), 0.8), torch.full((B,), 0.8), torch.full((B,), 30, dtype=torch.int32)]
            seed, step = torch.tensor([1, 2]), torch.tensor([0, 5])
            args += [seed, step] if frame.seeded else [fast_ar_uniforms(seed, step, n, residual)]
            names = frame.input_names()
            axes = {k: {0: "batch"} for k in names + ["codes"]}
            export_graph(frame, args, path, names, ["codes"], axes)
            sizes = {"batch": profiles.fast_ar_batch}
        elif name in ("dac_decoder", "dac_decoder_stream"):
            stream = name == "dac_decoder_stream"
            g = CodecDecoderGraph(codec, stream=stream, max_positions=max_positions)
            C = codec.config.num_codebooks
            args = [torch.randint(0, codec.config.codebook_size, (B, C, 3), generator=gen, dtype=torch.int32)]
            if stream:
                args += g.flatten_state(codec.new_stream_state(B))
            axes = {"codes": {0: "batch", 2: "frames"}, "audio": {0: "batch", 1: "samples"}}
            axes.update({k: {0: "batch"} for k in g.input_names()[1:] + g.output_names()[1:]})
            export_graph(g, args, path, g.input_names(), g.output_names(), axes)
            sizes = {"batch": profiles.stream_batch if stream else profiles.decoder_batch,
                     "frames": profiles.stream_frames if stream else profiles.decoder_frames}
        else:  # dac_encoder
            g = CodecEncoderGraph(codec, max_positions=max_positions // 2)
            args = [torch.randn(B, 1, 3 * codec.frame_length, generator=gen) * 0.1]
            axes = {"waveform": {0: "batch", 2: "samples"}, "codes": {0: "batch", 2: "frames"}}
            export_graph(g, args, path, ["waveform"], ["codes"], axes)
            fr = profiles.encoder_frames
            sizes = {"batch": profiles.encoder_batch, "samples": tuple(f * codec.frame_length for f in fr)}
        io = graph_io(path)
        entry = {"file": path.name, **io}
        axis_names = {k: {ax: n for ax, n in v.items()} for k, v in axes.items()}
        shapes = _shape_sets(io, sizes, axis_names)
        entry["profile"] = {"sizes": {k: list(v) for k, v in sizes.items()}, "shapes": shapes,
                            "trtexec": {w: _trtexec_shapes(s) for w, s in shapes.items()}}
        if name == "dac_decoder_stream":
            entry["state"] = [{"key": k, "input": state_tensor_name(k), "output": state_tensor_name(k, new=True),
                               "dims": list(g.state_shapes[k]), "data_type": "TYPE_INT64" if g.state_dtypes[k] == torch.long else "TYPE_FP32"}
                              for k in g.state_keys]
            entry["max_positions"] = max_positions
        manifest["graphs"][name] = entry
        log.info("exported %s in %.1f s", path, time.monotonic() - t0)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return manifest


def load_manifest(directory: str | Path) -> dict:
    f = Path(directory) / MANIFEST
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: export the graphs first (python build/export_onnx.py --checkpoint DIR --out {directory})")
    return json.loads(f.read_text(encoding="utf-8"))
