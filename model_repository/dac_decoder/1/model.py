"""dac_decoder: codes -> float32 audio, chunk by chunk, with a decoder state per stream.

Each request is one chunk `[1, num_codebooks, frames]` of the stream `stream_id`; the
stream's decoder state (conv left context, transformer window) is kept here between
chunks so that the chunks join without seams, and released by `final`. Requests that
Triton's dynamic batcher hands over together are decoded as one batch per chunk length.
"""

import json
import time

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
        return tu.decode_chunk_requests(self.decoder, requests, now=time.monotonic())
