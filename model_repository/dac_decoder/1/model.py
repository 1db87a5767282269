"""dac_decoder: codes -> float32 audio, chunk by chunk, with a decoder state per stream.

Each request is one chunk `[1, num_codebooks, frames]` of the stream `stream_id`; the
stream's decoder state (conv left context, transformer window) is kept here between
chunks so that the chunks join without seams, and released by `final`. Requests that
Triton's dynamic batcher hands over together are decoded as one batch per chunk length.
"""

import json
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.checkpoint import load_codec_from_dir
from s2tts.codec_stream import StreamDecoder

IDLE_TIMEOUT_S = 600.0


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.log = tu.setup_logging("dac_decoder")
        ckpt = tu.get_param(cfg, "checkpoint")
        if not ckpt:
            raise ValueError("dac_decoder: set the `checkpoint` parameter in config.pbtxt")
        tu.codec_precision(tu.get_param(cfg, "dtype", str, "fp32"), tu.get_param(cfg, "tf32", bool, True))
        codec = load_codec_from_dir(ckpt, tu.get_param(cfg, "device", str, "auto"), tu.get_param(cfg, "dtype", str, "fp32"))
        self.decoder = StreamDecoder(codec, idle_timeout_s=IDLE_TIMEOUT_S)

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
        except ValueError as e:
            for i, *_ in jobs:
                errors.setdefault(i, str(e))
        out = []
        for i in range(len(requests)):
            if i in results:
                out.append(pb_utils.InferenceResponse(output_tensors=[tu.tensor("audio", results[i][None])]))
            else:
                out.append(tu.error_response(errors.get(i, "dac_decoder: no result")))
        return out
