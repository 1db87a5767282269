"""fast_ar: residual codes of one frame for a batch of rows (hidden state + code 0 + sampling).

The same `s2tts.engine.InProcessFastAR` that slow_ar runs in-process by default.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import errors, settings
from s2tts.serving import triton_io as tio
from s2tts.serving.process import load_on_first_request, setup_logging
from s2tts.codec.loading import codec_codebook_sizes
from s2tts.ar.loading import load_model
from s2tts.engine import InProcessFastAR


class TritonPythonModel:
    def initialize(self, args):
        import torch

        self.v = v = settings.model_values(json.loads(args["model_config"]), "fast_ar")
        self.log = setup_logging("fast_ar")
        self.max_rows, self.torch, self.run = v.fast_ar_max_batch, torch, None
        if v.fast_ar == "bls":
            self._load("ready")
        else:
            # slow_ar runs its own fast AR (fast_ar=inprocess): this model serves direct callers only and holds no
            # weights until one comes (S2 Pro's fast AR and its caches: ~1.5 GB of a GPU)
            self.log.info("fast_ar ready: direct callers only (fast_ar=%s); the weights load on the first request",
                          v.fast_ar)

    def _load(self, what: str) -> None:
        v = self.v
        model = load_model(v.checkpoint, v.device, v.dtype, parts=("fast",))
        p = next(model.fast.parameters())
        model.fast.setup_caches(self.max_rows, p.dtype, p.device)
        self.device, self.dtype = p.device, p.dtype
        self.run = InProcessFastAR(model, codec_codebook_sizes(v.checkpoint)[1])
        self.log.info("fast_ar %s: device=%s dtype=%s, up to %d rows a request", what, p.device, p.dtype, self.max_rows)

    def execute(self, requests):
        if self.run is None:
            failed = load_on_first_request(lambda: self._load("loaded its weights for a direct request"), requests,
                                              "fast_ar", self.log, "the weights")
            if failed is not None:
                return failed
        torch = self.torch
        out = []
        for request in requests:
            try:
                s2 = self.run.model.s2
                x = tio.read_fast_rows(request, s2.text.dim, s2.num_semantic, self.max_rows)
                t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), device=self.device).to(dt)  # noqa: E731
                with torch.inference_mode():
                    codes = self.run(t(x["hidden"], self.dtype), t(x["code0"], torch.int64),
                                     t(x["temperature"], torch.float32), t(x["top_p"], torch.float32),
                                     t(x["top_k"], torch.int64), t(x["seed"], torch.int64), t(x["step"], torch.int64))
                out.append(pb_utils.InferenceResponse(output_tensors=[tio.tensor("codes", codes.to(torch.int32).cpu().numpy())]))
            except Exception as e:  # noqa: BLE001 - one bad request never fails the others
                out.append(tio.s2_error_response(errors.from_exception(e, "fast_ar")))
        return out
