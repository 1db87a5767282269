"""A Python-backend stand-in for a `*_trt` model: runs the exported ONNX graph with onnxruntime.

`backend=onnxruntime` renders the TensorRT variant of the repository with these in place of
the TensorRT engines (same names, inputs and outputs), so the whole variant (ensemble, BLS
calls, decoder state handling) runs on machines without TensorRT, e.g. CPU-only CI.
"""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts.serving import triton_io as tio

from s2tts.serving.process import setup_logging
from s2tts.export.runtime import ort_session


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        setup_logging(cfg["name"])
        path = tio.get_param(cfg, "onnx")
        if not path:
            raise ValueError(f"{cfg['name']}: set the `onnx` parameter (the exported graph)")
        self.session = ort_session(path, threads=tio.get_param(cfg, "threads", int, None))
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.name = cfg["name"]

    def execute(self, requests):
        out = []
        for request in requests:
            try:
                feed = {n: np.ascontiguousarray(pb_utils.get_input_tensor_by_name(request, n).as_numpy()) for n in self.inputs}
                result = self.session.run(self.outputs, feed)
                out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, r) for n, r in zip(self.outputs, result)]))
            except Exception as e:
                out.append(tio.error_response(f"{self.name}: {e}"))
        return out
