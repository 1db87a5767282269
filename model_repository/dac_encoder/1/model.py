"""dac_encoder: a reference waveform (any sample rate, float PCM) -> DAC codes [num_codebooks, frames]."""

import json

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
                wav, sr = tu.read_waveform(request, self.max_seconds)
                x = prepare_audio(wav, sr, self.codec.config.sample_rate).to(self.device)
                with self.torch.inference_mode():
                    codes = self.codec.encode(x)[0].to(self.torch.int32).cpu().numpy()
                out.append(pb_utils.InferenceResponse(output_tensors=[tu.tensor("codes", codes)]))
            except ValueError as e:
                out.append(tu.error_response(str(e)))
            except Exception as e:
                out.append(tu.error_response(f"dac_encoder: {e}", "INTERNAL"))
        return out
