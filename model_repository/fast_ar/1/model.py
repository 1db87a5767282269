"""fast_ar: residual codes of one frame for a batch of rows (hidden state + code 0 + sampling).

The same `s2tts.engine.InProcessFastAR` that slow_ar runs in-process by default.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import errors, settings
from s2tts import triton_utils as tu
from s2tts.checkpoint import codec_codebook_sizes, load_model
from s2tts.engine import InProcessFastAR


class TritonPythonModel:
    def initialize(self, args):
        import torch

        v = settings.model_values(json.loads(args["model_config"]), "fast_ar")
        tu.setup_logging("fast_ar")
        ckpt = v.checkpoint
        model = load_model(ckpt, v.device, v.dtype, parts=("fast",))
        self.max_rows = v.fast_ar_max_batch
        p = next(model.fast.parameters())
        model.fast.setup_caches(self.max_rows, p.dtype, p.device)
        self.run = InProcessFastAR(model, codec_codebook_sizes(ckpt)[1])
        self.device, self.dtype, self.torch = p.device, p.dtype, torch

    def execute(self, requests):
        torch = self.torch
        out = []
        for request in requests:
            try:
                get = lambda n: pb_utils.get_input_tensor_by_name(request, n).as_numpy()  # noqa: E731
                hidden = get("hidden")
                B = hidden.shape[0]
                if B > self.max_rows:
                    raise errors.invalid(f"at most {self.max_rows} rows per request (got {B}): raise the setting "
                                         "fast_ar_max_batch", "hidden")
                t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), device=self.device).to(dt)  # noqa: E731
                with torch.inference_mode():
                    codes = self.run(t(hidden, self.dtype), t(get("code0"), torch.int64), t(get("temperature"), torch.float32),
                                     t(get("top_p"), torch.float32), t(get("top_k"), torch.int64), t(get("seed"), torch.int64),
                                     t(get("step"), torch.int64))
                out.append(pb_utils.InferenceResponse(output_tensors=[tu.tensor("codes", codes.to(torch.int32).cpu().numpy())]))
            except Exception as e:  # noqa: BLE001 - one bad request never fails the others
                out.append(tu.s2_error_response(errors.from_exception(e, "fast_ar")))
        return out
