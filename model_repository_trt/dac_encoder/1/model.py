"""dac_encoder (TensorRT variant): a reference waveform (any sample rate, float PCM) -> DAC codes [num_codebooks, frames].

Resampled here to the codec rate and padded to whole frames; encoded by the `engine_model`
(dac_encoder_trt, the exported encoder) through BLS.
"""

import json

import triton_python_backend_utils as pb_utils

from s2tts import errors
from s2tts.serving import triton_io as tio
from s2tts.serving.process import setup_logging
from s2tts.export.driver import load_manifest
from s2tts.export.runtime import triton_bls_runner


class TritonPythonModel:
    def initialize(self, args):
        import torch

        cfg = json.loads(args["model_config"])
        setup_logging("dac_encoder")
        engine_dir = tio.get_param(cfg, "engine_dir")
        if not engine_dir:
            raise ValueError("dac_encoder: set the `engine_dir` parameter (the directory of manifest.json and the engines)")
        manifest = load_manifest(engine_dir)
        self.sample_rate = manifest["sample_rate"]
        self.frame_length = manifest["frame_length"]
        self.max_frames = manifest["graphs"]["dac_encoder"]["profile"]["sizes"]["samples"][2] // self.frame_length
        self.max_seconds = tio.get_param(cfg, "max_reference_seconds", float, 30.0)
        self.device = tio.get_param(cfg, "device", str, "cuda")
        self.run = triton_bls_runner(tio.get_param(cfg, "engine_model", str, "dac_encoder_trt"), ["codes"], self.device)
        self.torch = torch

    def execute(self, requests):
        from s2tts.codec.audio import prepare_audio

        torch = self.torch
        out = []
        for request in requests:
            try:
                wav, sr = tio.read_waveform(request, self.max_seconds)
                x = prepare_audio(wav, sr, self.sample_rate)
                x = torch.nn.functional.pad(x, (0, -x.shape[-1] % self.frame_length))
                if x.shape[-1] // self.frame_length > self.max_frames:
                    raise ValueError(f"waveform is longer than the encoder engine's profile ({self.max_frames} frames): trim it")
                codes = self.run({"waveform": x.to(self.device)})["codes"][0]
                out.append(pb_utils.InferenceResponse(output_tensors=[tio.tensor("codes", codes.to(torch.int32).cpu().numpy())]))
            except Exception as e:  # noqa: BLE001 - one bad request never fails the others
                out.append(tio.s2_error_response(errors.from_exception(e, "dac_encoder")))
        return out
