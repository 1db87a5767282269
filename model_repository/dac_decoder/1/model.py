"""dac_decoder: codes -> float32 audio, chunk by chunk, with a decoder state per stream.

Each request is one chunk `[1, frames, num_codebooks]` of the stream `stream_id`; `start`
opens the stream, `final` releases it. The state (conv left context, transformer window)
is kept between chunks so that they join without seams (`s2tts.codec_stream`). Requests
that Triton's dynamic batcher hands over together are decoded as one batch per chunk length.
"""

import json
import time

from s2tts import settings
from s2tts import triton_utils as tu
from s2tts.checkpoint import load_codec_from_dir
from s2tts.codec_stream import StreamDecoder


class TritonPythonModel:
    def initialize(self, args):
        v = settings.model_values(json.loads(args["model_config"]), "dac_decoder")
        self.log = tu.setup_logging("dac_decoder")
        tu.codec_precision(v.codec_dtype, v.codec_tf32)
        codec = load_codec_from_dir(v.checkpoint, v.codec_device, v.codec_dtype)
        self.decoder = StreamDecoder(codec, idle_timeout_s=v.codec_idle_timeout_s)
        self.metrics = tu.Metrics("dac_decoder")

    def execute(self, requests):
        out = tu.decode_chunk_requests(self.decoder, requests, now=time.monotonic())
        self.metrics.set("s2tts_codec_streams_open", len(self.decoder.states))
        return out
