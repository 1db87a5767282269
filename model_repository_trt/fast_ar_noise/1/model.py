"""fast_ar_noise: (seed, step) -> the fast AR's random numbers [rows, num_codebooks-1, residual codebook size].

First step of the `fast_ar` ensemble of the TensorRT variant: the same numbers
`s2tts.ar.sampling.sample` draws for codebooks 1..9, so fast_ar_trt samples what the
PyTorch fast AR samples.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts.serving import triton_io as tio

from s2tts.serving.process import setup_logging
from s2tts.gpu.device import resolve_device
from s2tts.export.driver import load_manifest
from s2tts.export.onnx_graphs import fast_ar_uniforms
from s2tts.export.runtime import to_triton_tensor


class TritonPythonModel:
    def initialize(self, args):
        import torch

        cfg = json.loads(args["model_config"])
        setup_logging("fast_ar_noise")
        engine_dir = tio.get_param(cfg, "engine_dir")
        if not engine_dir:
            raise ValueError("fast_ar_noise: set the `engine_dir` parameter (the directory of manifest.json)")
        manifest = load_manifest(engine_dir)
        self.n = manifest["num_codebooks"] - 1
        self.vocab = manifest["residual_size"]
        self.device = resolve_device(tio.get_param(cfg, "device", str, "auto"))
        self.torch = torch

    def execute(self, requests):
        torch = self.torch
        out = []
        for request in requests:
            try:
                seed = pb_utils.get_input_tensor_by_name(request, "seed").as_numpy().reshape(-1)
                step = pb_utils.get_input_tensor_by_name(request, "step").as_numpy().reshape(-1)
                if seed.shape != step.shape:
                    raise ValueError(f"seed and step must have one value per row (got {seed.size} and {step.size})")
                s = torch.as_tensor(np.ascontiguousarray(seed, dtype=np.int64), device=self.device)
                t = torch.as_tensor(np.ascontiguousarray(step, dtype=np.int64), device=self.device)
                u = fast_ar_uniforms(s, t, self.n, self.vocab)
                out.append(pb_utils.InferenceResponse(output_tensors=[to_triton_tensor("uniforms", u)]))
            except Exception as e:
                out.append(tio.error_response(f"fast_ar_noise: {e}"))
        return out
