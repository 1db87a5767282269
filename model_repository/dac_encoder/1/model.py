"""dac_encoder: a reference waveform (any sample rate, float PCM) -> DAC codes [num_codebooks, frames]."""

import json

import triton_python_backend_utils as pb_utils

from s2tts import errors, settings
from s2tts.serving import triton_io as tio
from s2tts.serving.process import setup_logging
from s2tts.codec.model import codec_precision
from s2tts.codec.loading import codec_dtype_for, load_codec_from_dir


class TritonPythonModel:
    def initialize(self, args):
        import torch

        v = settings.model_values(json.loads(args["model_config"]), "dac_encoder")
        self.log = setup_logging("dac_encoder")
        dtype = codec_dtype_for(v.codec_dtype, v.codec_device, "encoder")
        codec_precision(dtype, v.codec_tf32)
        self.codec = load_codec_from_dir(v.checkpoint, v.codec_device, dtype).drop_decoding()
        self.device = next(self.codec.parameters()).device
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the decoder's weights, dropped, back to the driver
        self.max_seconds = v.max_reference_seconds
        self.torch = torch

    def execute(self, requests):
        from s2tts.codec.audio import prepare_audio

        out = []
        for request in requests:
            try:
                wav, sr = tio.read_waveform(request, self.max_seconds)
                x = prepare_audio(wav, sr, self.codec.config.sample_rate).to(self.device)
                with self.torch.inference_mode():
                    codes = self.codec.encode(x)[0].to(self.torch.int32).cpu().numpy()
                out.append(pb_utils.InferenceResponse(output_tensors=[tio.tensor("codes", codes)]))
            except Exception as e:  # noqa: BLE001 - one bad request never fails the others
                err = errors.from_exception(e, "dac_encoder")
                if err.code != "invalid_argument":
                    self.log.exception("dac_encoder: request %s failed", request.request_id())
                out.append(tio.s2_error_response(err))
        return out
