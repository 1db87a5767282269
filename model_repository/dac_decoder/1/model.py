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
from s2tts.codec_stream import open_stream_decoder
from s2tts.service import Chunker


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        v = settings.model_values(cfg, "dac_decoder")
        self.name = args.get("model_name", "dac_decoder")  # dac_decoder_i: a replica (s2tts/layout.py)
        self.log = tu.setup_logging(self.name)
        tu.codec_precision("fp32", v.codec_tf32)  # the fp32 codec, or the fallback of an fp16 one
        t0 = time.monotonic()
        lengths = Chunker.lengths(v.first_chunk_frames, v.chunk_frames)
        # with codec_in_engine slow_ar decodes the served streams: this model serves direct callers only, eagerly,
        # without the pool's memory and CUDA graphs
        self.decoder, dtype, graphs = open_stream_decoder(
            v.checkpoint, v.codec_device, v.codec_dtype, 0 if v.codec_in_engine else v.codec_max_streams,
            v.codec_idle_timeout_s, lengths, cfg.get("max_batch_size", 1))
        if self.decoder.pool is not None:
            self.log.info("%s: %d stream slots (%.0f MiB); chunk lengths %s prepared, %d CUDA graphs in %.1f s", self.name,
                          self.decoder.pool.size, self.decoder.pool.bytes / 2**20, lengths, graphs, time.monotonic() - t0)
        self.metrics = tu.Metrics(self.name)
        self.metrics.declare("s2tts_codec_batch_size")
        self.log.info("%s ready: device=%s dtype=%s%s", self.name, self.decoder.device, dtype,
                      " (fp32 fallback for chunks that overflow)" if self.decoder.fallback is not None else "")

    def execute(self, requests):
        out = tu.decode_chunk_requests(self.decoder, requests, now=time.monotonic(), name=self.name)
        self.metrics.report_codec(self.decoder)
        self.metrics.flush()
        return out

    def finalize(self):
        self.metrics.close()
