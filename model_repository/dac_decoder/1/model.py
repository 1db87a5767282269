"""dac_decoder: codes -> float32 audio, chunk by chunk, with a decoder state per stream.

Each request is one chunk `[1, frames, num_codebooks]` of the stream `stream_id`; `start`
opens the stream, `final` releases it. The state (conv left context, transformer window)
is kept between chunks so that they join without seams (`s2tts.codec.stream`). Requests
that Triton's dynamic batcher hands over together are decoded as one batch per chunk length.
"""

import json
import time

from s2tts import settings
from s2tts.serving import triton_io as tio
from s2tts.serving.metrics import Metrics
from s2tts.serving.process import load_on_first_request, setup_logging
from s2tts.codec.model import codec_precision
from s2tts.engine.chunking import Chunker
from s2tts.codec.stream import making_line, open_stream_decoder


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        v = settings.model_values(cfg, "dac_decoder")
        self.name = args.get("model_name", "dac_decoder")  # dac_decoder_i: a replica (s2tts/layout.py)
        self.log = setup_logging(self.name)
        codec_precision("fp32", v.codec_tf32)  # the fp32 codec, or the fallback of an fp16 one
        self.v, self.max_batch = v, cfg.get("max_batch_size", 1)
        self.metrics = Metrics(self.name)
        self.metrics.declare("s2tts_codec_batch_size")
        self.decoder = None
        if v.codec_in_engine:
            # slow_ar decodes the served streams in its own loop: this model serves direct callers only, eagerly,
            # without the pool, and holds no codec until one comes (S2 Pro's decoder and its fp32 fallback: ~2 GB)
            self.log.info("%s ready: direct callers only (codec_in_engine); the codec loads on the first request",
                          self.name)
        else:
            self._open("ready")

    def _open(self, what: str):
        v, t0 = self.v, time.monotonic()
        lengths = Chunker.lengths(v.first_chunk_frames, v.chunk_frames)
        self.decoder, dtype, graphs = open_stream_decoder(
            v.checkpoint, v.codec_device, v.codec_dtype, 0 if v.codec_in_engine else v.codec_max_streams,
            v.codec_idle_timeout_s, lengths, self.max_batch)
        if self.decoder.pool is not None:
            self.log.info("%s: %d stream slots (%.0f MiB); chunk lengths %s prepared, %d CUDA graphs in %.1f s", self.name,
                          self.decoder.pool.size, self.decoder.pool.bytes / 2**20, lengths, graphs, time.monotonic() - t0)
        self.log.info("%s %s: device=%s dtype=%s%s in %.1f s%s", self.name, what, self.decoder.device, dtype,
                      " (fp32 fallback for chunks that overflow)" if self.decoder.fallback is not None else "",
                      time.monotonic() - t0, making_line(self.decoder.making))

    def execute(self, requests):
        if self.decoder is None:
            failed = load_on_first_request(lambda: self._open("loaded its codec for a direct request"), requests,
                                              self.name, self.log, "the codec")
            if failed is not None:
                return failed
        out = tio.decode_chunk_requests(self.decoder, requests, now=time.monotonic(), name=self.name)
        self.metrics.report_codec(self.decoder)
        self.metrics.flush()
        return out

    def finalize(self):
        self.metrics.close()
