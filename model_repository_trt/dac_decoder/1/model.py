"""dac_decoder (TensorRT variant): codes -> float32 audio, chunk by chunk, with a decoder state per stream.

The contract of the Python-backend dac_decoder; the state of each stream is kept here
(as tensors on `device`) and every chunk is computed by the `engine_model` (dac_decoder_trt,
the exported streaming decoder) through BLS: codes + state in, audio + new state out.
"""

import json
import time

import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.codec_stream import StreamDecoder
from s2tts.export import GraphStreamCodec, load_manifest, triton_bls_runner

IDLE_TIMEOUT_S = 600.0


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.log = tu.setup_logging("dac_decoder")
        engine_dir = tu.get_param(cfg, "engine_dir")
        if not engine_dir:
            raise ValueError("dac_decoder: set the `engine_dir` parameter (the directory of manifest.json and the engines)")
        manifest = load_manifest(engine_dir)
        spec = manifest["graphs"]["dac_decoder_stream"]
        device = tu.get_param(cfg, "device", str, "cuda")
        run = triton_bls_runner(tu.get_param(cfg, "engine_model", str, "dac_decoder_trt"), [o["name"] for o in spec["outputs"]], device)
        self.decoder = StreamDecoder(GraphStreamCodec(run, manifest, device=device), idle_timeout_s=IDLE_TIMEOUT_S)

    def execute(self, requests):
        jobs, errors = [], {}
        for i, request in enumerate(requests):
            try:
                codes = pb_utils.get_input_tensor_by_name(request, "codes").as_numpy()
                sid = pb_utils.get_input_tensor_by_name(request, "stream_id").as_numpy().reshape(-1)[0]
                final = bool(pb_utils.get_input_tensor_by_name(request, "final").as_numpy().reshape(-1)[0])
                sid = sid.decode() if isinstance(sid, bytes) else str(sid)
                jobs.append((i, sid, codes.reshape(codes.shape[-2], codes.shape[-1]), final))
            except Exception as e:
                errors[i] = f"dac_decoder: bad request: {e}"
        results = {}
        try:
            for i, audio in self.decoder.decode_many(jobs, now=time.monotonic()).items():
                results[i] = audio
        except Exception as e:
            for i, *_ in jobs:
                errors.setdefault(i, f"dac_decoder: {e}")
        out = []
        for i in range(len(requests)):
            if i in results:
                out.append(pb_utils.InferenceResponse(output_tensors=[tu.tensor("audio", results[i][None])]))
            else:
                out.append(tu.error_response(errors.get(i, "dac_decoder: no result")))
        return out
