"""Whether an exported graph computes what PyTorch does: `check_exports` runs each graph (onnxruntime) against the
PyTorch modules with the limits in `LIMITS`; `tensorrt_lint` judges a graph against TensorRT 10's ONNX
operator table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..ar.loading import load_model
from ..codec.loading import load_codec_from_dir
from ..engine import InProcessFastAR
from .driver import load_manifest
from .onnx_graphs import fast_ar_uniforms
from .runtime import GraphStreamCodec, ort_runner


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| (L2 over all elements), float64."""
    a = torch.as_tensor(np.asarray(a) if not isinstance(a, torch.Tensor) else a).double()
    b = torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b).double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# What the checks accept. Audio and states are fp32 graphs against fp32 PyTorch (measured ~3e-6);
# fast-AR codes must be identical (a flip needs two candidates within float rounding of each other);
# encoder codes are nearest-neighbour picks, where rounding can flip a near tie.
LIMITS = {"audio_rel": 1e-4, "state_rel": 1e-4, "fast_ar_row_mismatch": 0.0, "encoder_code_mismatch": 0.01}


@dataclass
class Check:
    graph: str
    metric: str
    value: float
    limit: float
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.value <= self.limit

    def line(self) -> str:
        extra = " ".join(f"{k}={v}" for k, v in self.detail.items())
        return f"{'ok  ' if self.ok else 'FAIL'} {self.graph:20s} {self.metric:22s} {self.value:.3g} (limit {self.limit:g}) {extra}"


def random_sampling_inputs(batch: int, dim: int, code0_size: int, seed: int = 0, scale: float = 3.0) -> dict:
    """Random fast-AR inputs: hidden states, code 0, and sampling settings across their ranges (top_k 0 = off)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden": torch.randn(batch, dim, generator=g) * scale,
        "code0": torch.randint(0, code0_size, (batch,), generator=g, dtype=torch.int32),
        "temperature": torch.rand(batch, generator=g) * 1.5 + 0.05,
        "top_p": torch.rand(batch, generator=g) * 0.95 + 0.05,
        "top_k": torch.randint(0, 50, (batch,), generator=g, dtype=torch.int32),
        "seed": torch.randint(0, 2**62, (batch,), generator=g),
        "step": torch.randint(0, 4096, (batch,), generator=g),
    }


def reference_fast_ar(model, residual: int, x: dict) -> torch.Tensor:
    """Codes of the cached PyTorch fast AR (`InProcessFastAR`, the engine's own path) for the inputs x."""
    B = x["hidden"].shape[0]
    p = next(model.fast.parameters())
    model.fast.setup_caches(B, p.dtype, p.device)
    with torch.inference_mode():
        return InProcessFastAR(model, residual)(x["hidden"].to(p.dtype), x["code0"].long(), x["temperature"], x["top_p"],
                                                x["top_k"].long(), x["seed"], x["step"])


def check_fast_ar(onnx_dir, model, residual: int, batch: int = 64, rounds: int = 2, seeded: bool = False) -> Check:
    name = "fast_ar_seeded" if seeded else "fast_ar"
    run = ort_runner(Path(onnx_dir) / f"{name}.onnx")
    n = model.s2.num_codebooks - 1
    rows = bad = codes_bad = 0
    for r in range(rounds):
        x = random_sampling_inputs(batch, model.s2.audio.dim, model.s2.codebook_size, seed=1000 + r)
        ref = reference_fast_ar(model, residual, x)
        feed = {k: x[k] for k in ("hidden", "code0", "temperature", "top_p", "top_k")}
        if seeded:
            feed.update(seed=x["seed"], step=x["step"])
        else:
            feed["uniforms"] = fast_ar_uniforms(x["seed"], x["step"], n, residual)
        got = torch.as_tensor(run(feed)["codes"]).long()
        diff = got != ref
        rows += batch
        bad += int(diff.any(dim=1).sum())
        codes_bad += int(diff.sum())
    return Check(name, "row mismatch rate", bad / rows, LIMITS["fast_ar_row_mismatch"],
                 {"rows": rows, "rows_differing": bad, "codes_differing": codes_bad})


def _random_codes(codec, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = codec.config
    semantic = torch.randint(0, cfg.semantic_codebook_size, (batch, 1, frames), generator=g)
    residual = torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, frames), generator=g)
    return torch.cat([semantic, residual], dim=1)


def check_decoder(onnx_dir, codec, batch: int = 2, frames: int = 24, seed: int = 0) -> Check:
    codes = _random_codes(codec, batch, frames, seed)
    with torch.inference_mode():
        ref = codec.decode(codes)[:, 0]
    got = ort_runner(Path(onnx_dir) / "dac_decoder.onnx")({"codes": codes.to(torch.int32)})["audio"]
    return Check("dac_decoder", "audio relative error", relative_error(got, ref), LIMITS["audio_rel"],
                 {"batch": batch, "frames": frames})


def check_stream_decoder(onnx_dir, codec, manifest: dict, batch: int = 2, chunks=(3, 1, 16, 20), seed: int = 1) -> list[Check]:
    """Decode a stream chunk by chunk through the graph (state carried out and back in) against `DAC.decode_stream`."""
    codes = _random_codes(codec, batch, sum(chunks), seed)
    stream = GraphStreamCodec(ort_runner(Path(onnx_dir) / "dac_decoder_stream.onnx"), manifest)
    st_ref, st = codec.new_stream_state(batch), stream.new_stream_state(batch)
    ref, got, f0 = [], [], 0
    with torch.inference_mode():
        for n in chunks:
            a, st_ref = codec.decode_stream(codes[:, :, f0 : f0 + n], st_ref)
            b, st = stream.decode_stream(codes[:, :, f0 : f0 + n], st)
            ref.append(a)
            got.append(b)
            f0 += n
    ref, got = torch.cat(ref, -1), torch.cat(got, -1)
    keys = [k for k in st_ref.tensors if not k.endswith(".pos")]
    pos_equal = all(torch.equal(st.tensors[k].cpu(), st_ref.tensors[k].cpu()) for k in st_ref.tensors if k.endswith(".pos"))
    state_err = max(relative_error(st.tensors[k], st_ref.tensors[k]) for k in keys)
    detail = {"batch": batch, "chunks": "+".join(map(str, chunks))}
    return [Check("dac_decoder_stream", "audio relative error", relative_error(got, ref), LIMITS["audio_rel"], detail),
            Check("dac_decoder_stream", "state relative error", state_err if pos_equal else math.inf, LIMITS["state_rel"],
                  {"positions_equal": pos_equal, "tensors": len(st_ref.tensors)})]


def _decoded_audio(codec, batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    """[B, 1, frames*frame_length] of decoded random codes: audio the codec's own encoder maps to clear codes."""
    with torch.inference_mode():
        return codec.decode(_random_codes(codec, batch, frames, seed)).float()


def check_encoder(onnx_dir, codec, batch: int = 2, frames: int = 24, seed: int = 2) -> Check:
    audio = _decoded_audio(codec, batch, frames, seed)
    with torch.inference_mode():
        ref = codec.encode(audio)
    got = torch.as_tensor(ort_runner(Path(onnx_dir) / "dac_encoder.onnx")({"waveform": audio})["codes"]).long()
    if got.shape != ref.shape:
        return Check("dac_encoder", "code mismatch rate", math.inf, LIMITS["encoder_code_mismatch"], {"shape": tuple(got.shape)})
    return Check("dac_encoder", "code mismatch rate", float((got != ref).float().mean()), LIMITS["encoder_code_mismatch"],
                 {"batch": batch, "frames": frames, "codes": ref.numel()})


def check_exports(onnx_dir, checkpoint=None, model=None, codec=None, graphs=None) -> list[Check]:
    """Every exported graph in `onnx_dir` run by onnxruntime (CPU) against the PyTorch modules."""
    manifest = load_manifest(onnx_dir)
    checkpoint = checkpoint or manifest["checkpoint"]
    graphs = graphs or list(manifest["graphs"])
    if model is None and any(g.startswith("fast_ar") for g in graphs):
        model = load_model(checkpoint, "cpu", "fp32", parts=("fast",))
    if codec is None and any(g.startswith("dac_") for g in graphs):
        codec = load_codec_from_dir(checkpoint, "cpu", "fp32")
    out = []
    for g in graphs:
        if g in ("fast_ar", "fast_ar_seeded"):
            out.append(check_fast_ar(onnx_dir, model, manifest["residual_size"], seeded=g == "fast_ar_seeded"))
        elif g == "dac_decoder":
            out.append(check_decoder(onnx_dir, codec))
        elif g == "dac_decoder_stream":
            out += check_stream_decoder(onnx_dir, codec, manifest)
        elif g == "dac_encoder":
            out.append(check_encoder(onnx_dir, codec))
    return out


# --------------------------------------------------------------------------- TensorRT parser lint

_F, _I, _L, _B = ("FLOAT", "FLOAT16", "BFLOAT16"), ("INT32",), ("INT64",), ("BOOL",)
# onnx-tensorrt docs/operators.md for TensorRT 10.0 (types of the data input), for the operators a
# PyTorch export of these modules can produce. Only TensorRT's parser can say more.
_TRT10 = {
    **{op: _F for op in ("Clip", "Conv", "ConvTranspose", "CumSum", "Erf", "LayerNormalization", "Log", "MatMul",
                         "Pow", "Reciprocal", "Sigmoid", "Sin", "Cos", "Softmax", "Sqrt", "Tanh", "Exp", "Floor", "Gelu")},
    **{op: _F + _I + _L for op in ("Add", "ArgMax", "Div", "Equal", "Greater", "GreaterOrEqual", "IsNaN", "Less",
                                   "LessOrEqual", "Max", "Min", "Mod", "Mul", "Neg", "Pad", "Range", "ReduceL2",
                                   "ReduceMean", "ReduceSum", "ReduceMax", "Sub", "TopK", "Abs")},
    **{op: _F + _I + _L + _B for op in ("Concat", "ConstantOfShape", "Expand", "Gather", "GatherElements", "Identity",
                                       "Reshape", "Shape", "Slice", "Split", "Squeeze", "Transpose", "Trilu",
                                       "Unsqueeze", "Where", "Cast", "Tile", "Flatten")},
    **{op: _B for op in ("And", "Or", "Xor", "Not")},
    "Constant": _F + _I + _L + _B,
}
_TRT10_UNSUPPORTED = {"BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "NonZero", "Unique",
                      "SplitToSequence", "ConcatFromSequence", "SequenceAt", "SequenceConstruct", "StringNormalizer"}
_TRT10_CONSTANT_INPUTS = {"Slice": 3, "Squeeze": 1, "Unsqueeze": 1, "ReduceMean": 1, "ReduceSum": 1, "ReduceL2": 1,
                          "ReduceMax": 1, "Pad": 3, "CumSum": 1, "TopK": 1}


def tensorrt_lint(path: str | Path) -> list[str]:
    """Problems TensorRT 10's ONNX parser would have with the graph, judged from onnx-tensorrt's
    operator table: unsupported operators, unsupported data types, inputs that must be constants.
    An empty list is necessary, not sufficient, for `trtexec --onnx` to succeed."""
    import onnx
    from onnx import shape_inference

    model = shape_inference.infer_shapes(onnx.load(str(path)))
    g = model.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.value_info, *g.input, *g.output]}
    types.update({t.name: t.data_type for t in g.initializer})
    constants = {t.name for t in g.initializer}
    for n in g.node:
        if n.op_type == "Constant":
            constants.update(n.output)
            types[n.output[0]] = n.attribute[0].t.data_type if n.attribute and n.attribute[0].HasField("t") else 0
    problems = set()
    for n in g.node:
        op = n.op_type
        if op in _TRT10_UNSUPPORTED:
            problems.add(f"{op}: not supported by TensorRT")
            continue
        if op not in _TRT10:
            problems.add(f"{op}: not in the checked operator list")
            continue
        data = n.input[1] if op == "Where" else (n.input[0] if n.input else "")
        if data:
            tname = onnx.TensorProto.DataType.Name(types.get(data, 0))
            if tname not in _TRT10[op]:
                problems.add(f"{op}: data type {tname} not supported")
        k = _TRT10_CONSTANT_INPUTS.get(op)
        if k is not None and len(n.input) > k and n.input[k] and n.input[k] not in constants:
            problems.add(f"{op}: input {k} must be a constant")
        if op == "TopK":
            kv = next((onnx.numpy_helper.to_array(c.attribute[0].t) for c in g.node if c.op_type == "Constant" and c.output[0] == n.input[1]), None)
            if kv is not None and int(np.asarray(kv).reshape(-1)[0]) >= 3840:
                problems.add("TopK: K must be less than 3840")
    return sorted(problems)
