"""dac_encoder: a reference waveform (any sample rate, float PCM) -> DAC codes [num_codebooks, frames]."""

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.checkpoint import load_codec_from_dir


class TritonPythonModel:
    def initialize(self, args):
        import torch

        cfg = json.loads(args["model_config"])
        tu.setup_logging("dac_encoder")
        ckpt = tu.get_param(cfg, "checkpoint")
        if not ckpt:
            raise ValueError("dac_encoder: set the `checkpoint` parameter in config.pbtxt")
        tu.codec_precision(tu.get_param(cfg, "dtype", str, "fp32"), tu.get_param(cfg, "tf32", bool, True))
        self.codec = load_codec_from_dir(ckpt, tu.get_param(cfg, "device", str, "auto"), tu.get_param(cfg, "dtype", str, "fp32"))
        self.max_seconds = tu.get_param(cfg, "max_reference_seconds", float, 30.0)
        self.device = next(self.codec.parameters()).device
        self.torch = torch

    def execute(self, requests):
        from s2tts.codec import prepare_audio

        out = []
        for request in requests:
            try:
                wav = pb_utils.get_input_tensor_by_name(request, "waveform").as_numpy().astype(np.float32).reshape(-1)
                sr = int(pb_utils.get_input_tensor_by_name(request, "sample_rate").as_numpy().reshape(-1)[0])
                if not (8000 <= sr <= 192000):
                    raise ValueError(f"sample_rate must be between 8000 and 192000 Hz (got {sr})")
                if wav.size / sr > self.max_seconds:
                    raise ValueError(f"waveform is {wav.size / sr:.1f} s long, over the limit of {self.max_seconds:g} s: trim it")
                x = prepare_audio(wav, sr, self.codec.config.sample_rate).to(self.device)
                with self.torch.inference_mode():
                    codes = self.codec.encode(x)[0].to(self.torch.int32).cpu().numpy()
                out.append(pb_utils.InferenceResponse(output_tensors=[tu.tensor("codes", codes)]))
            except ValueError as e:
                out.append(tu.error_response(str(e)))
            except Exception as e:
                out.append(tu.error_response(f"dac_encoder: {e}", "INTERNAL"))
        return out
