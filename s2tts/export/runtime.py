"""Running the exported graphs: onnxruntime sessions (`ort_session`, `ort_runner`), `GraphStreamCodec` (the
streaming decoder over a graph, for `s2tts.codec.stream.StreamDecoder`), and the Triton glue the TensorRT /
onnxruntime variant models use (`to_triton_tensor`, `triton_bls_runner`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..codec.model import StreamState


def ort_session(path: str | Path, threads: int | None = None, providers=None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if threads:
        opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=providers or ["CPUExecutionProvider"])


def ort_runner(path: str | Path, threads: int | None = None, providers=None) -> Callable[[dict], dict]:
    """A function {input name: array or tensor} -> {output name: numpy array} over an onnxruntime session."""
    sess = ort_session(path, threads, providers)
    names = [o.name for o in sess.get_outputs()]

    def run(inputs: dict) -> dict:
        feed = {k: (v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in inputs.items()}
        return dict(zip(names, sess.run(names, feed)))

    return run


@dataclass
class _CodecInfo:
    num_codebooks: int
    frame_length: int
    sample_rate: int


class GraphStreamCodec:
    """A stand-in for the codec in `s2tts.codec.stream.StreamDecoder` whose `decode_stream` runs the
    exported streaming decoder graph through `run({name: tensor}) -> {name: array or tensor}`:
    onnxruntime in tests, a BLS call to `dac_decoder_trt` inside Triton.

    A chunk longer than `max_frames` or a batch larger than `max_batch` (the engine's profile) is
    cut into pieces that run one after the other through the state: the audio is the same.
    """

    def __init__(self, run: Callable[[dict], dict], manifest: dict, device="cpu", max_frames: int | None = None,
                 max_batch: int | None = None):
        spec = manifest["graphs"]["dac_decoder_stream"]
        self.run = run
        self.spec = spec
        self.state = spec["state"]
        self.config = _CodecInfo(manifest["num_codebooks"], manifest["frame_length"], manifest["sample_rate"])
        self.device = torch.device(device)
        sizes = spec["profile"]["sizes"]
        self.max_frames = max_frames or sizes["frames"][2]
        self.max_batch = max_batch or sizes["batch"][2]
        self.max_positions = spec.get("max_positions")
        self._anchor = torch.empty(0, device=self.device)

    def parameters(self):
        yield self._anchor

    @property
    def frame_length(self) -> int:
        return self.config.frame_length

    def new_stream_state(self, batch: int = 1):
        out = {}
        for s in self.state:
            if s["key"].endswith(".pos"):
                out[s["key"]] = torch.zeros(batch, dtype=torch.long, device=self.device)
            else:
                out[s["key"]] = torch.zeros(batch, *s["dims"], dtype=torch.float32, device=self.device)
        return StreamState(out)

    @staticmethod
    def stack_states(states):
        return StreamState.stack(states)

    @staticmethod
    def split_states(state):
        return state.split()

    def _piece(self, codes: torch.Tensor, tensors: dict) -> tuple[torch.Tensor, dict]:
        inputs = {"codes": codes.to(torch.int32)}
        for s in self.state:
            t = tensors[s["key"]]
            inputs[s["input"]] = t.reshape(t.shape[0], 1) if s["key"].endswith(".pos") else t
        outs = self.run(inputs)
        audio = torch.as_tensor(outs["audio"], device=self.device)
        new = {}
        for s in self.state:
            t = torch.as_tensor(outs[s["output"]], device=self.device)
            new[s["key"]] = t.reshape(-1) if s["key"].endswith(".pos") else t
        return audio, new

    def decode_stream(self, codes: torch.Tensor, state):
        """codes [B, C, f] -> (audio [B, 1, f*frame_length] float32, next state), as `DAC.decode_stream`."""
        codes = torch.as_tensor(codes, device=self.device)
        if codes.ndim == 2:
            codes = codes[None]
        C = self.config.num_codebooks
        if codes.ndim != 3 or codes.shape[1] != C:
            raise ValueError(f"codes must be [B, {C}, frames], got {tuple(codes.shape)}")
        if codes.shape[0] != state.batch_size:
            raise ValueError(f"codes have batch {codes.shape[0]} but the stream state has {state.batch_size}")
        f = codes.shape[-1]
        if f == 0:
            return torch.zeros(codes.shape[0], 1, 0, device=self.device), state
        if self.max_positions:
            pos_key = next(s["key"] for s in self.state if s["key"].endswith(".pos"))
            if int(state.tensors[pos_key].max()) + f > self.max_positions:
                raise ValueError(f"stream longer than {self.max_positions} frames: the exported decoder's RoPE table ends there")
        audios, states = [], []
        for b0 in range(0, codes.shape[0], self.max_batch):
            tensors = {k: t[b0 : b0 + self.max_batch] for k, t in state.tensors.items()}
            pieces = []
            for f0 in range(0, f, self.max_frames):
                audio, tensors = self._piece(codes[b0 : b0 + self.max_batch, :, f0 : f0 + self.max_frames], tensors)
                pieces.append(audio)
            audios.append(torch.cat(pieces, dim=-1))
            states.append(StreamState(tensors))
        new_state = states[0] if len(states) == 1 else StreamState.stack(states)
        return torch.cat(audios)[:, None].float(), new_state

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = torch.as_tensor(codes)
        if codes.ndim == 2:
            codes = codes[None]
        return self.decode_stream(codes, self.new_stream_state(codes.shape[0]))[0]


# --------------------------------------------------------------------------- Triton glue


def to_triton_tensor(name: str, t: torch.Tensor):
    """A pb_utils.Tensor of a torch tensor: through DLPack (no copy) on the GPU, as numpy on the CPU."""
    import triton_python_backend_utils as pb_utils

    t = t.contiguous()
    if t.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(t))
    return pb_utils.Tensor(name, t.numpy())


def triton_bls_runner(model_name: str, output_names: list[str], device="cuda") -> Callable[[dict], dict]:
    """A function {input name: torch tensor} -> {output name: torch tensor on `device`} calling
    `model_name` by BLS from inside a Python-backend model (tensors stay on the GPU)."""
    import triton_python_backend_utils as pb_utils

    device = torch.device(device)
    kwargs = {}
    if device.type == "cuda" and hasattr(pb_utils, "PreferredMemory"):
        kwargs["preferred_memory"] = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device.index or 0)

    def run(inputs: dict) -> dict:
        tensors = [to_triton_tensor(k, torch.as_tensor(v).to(device)) for k, v in inputs.items()]
        resp = pb_utils.InferenceRequest(model_name=model_name, inputs=tensors, requested_output_names=list(output_names),
                                         **kwargs).exec()
        if resp.has_error():
            raise RuntimeError(f"{model_name}: {resp.error().message()}")
        out = {}
        for n in output_names:
            t = pb_utils.get_output_tensor_by_name(resp, n)
            out[n] = torch.utils.dlpack.from_dlpack(t.to_dlpack()).to(device)
        return out

    return run
