"""dac_decoder (TensorRT variant): codes -> float32 audio, chunk by chunk, with a decoder state per stream.

The contract of the Python-backend dac_decoder; the state of each stream is kept here
(as tensors on `device`) and every chunk is computed by the `engine_model` (dac_decoder_trt,
the exported streaming decoder) through BLS: codes + state in, audio + new state out.
"""

import json
import time

from s2tts import settings
from s2tts.serving import triton_io as tio
from s2tts.serving.process import setup_logging
from s2tts.codec.stream import StreamDecoder
from s2tts.export.driver import load_manifest
from s2tts.export.runtime import GraphStreamCodec, triton_bls_runner


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.log = setup_logging("dac_decoder")
        engine_dir = tio.get_param(cfg, "engine_dir")
        if not engine_dir:
            raise ValueError("dac_decoder: set the `engine_dir` parameter (the directory of manifest.json and the engines)")
        manifest = load_manifest(engine_dir)
        spec = manifest["graphs"]["dac_decoder_stream"]
        device = tio.get_param(cfg, "device", str, "cuda")
        run = triton_bls_runner(tio.get_param(cfg, "engine_model", str, "dac_decoder_trt"), [o["name"] for o in spec["outputs"]], device)
        self.decoder = StreamDecoder(GraphStreamCodec(run, manifest, device=device), idle_timeout_s=settings.SCHEMA["codec_idle_timeout_s"].default)

    def execute(self, requests):
        return tio.decode_chunk_requests(self.decoder, requests, now=time.monotonic())
