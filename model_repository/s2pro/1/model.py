"""s2pro: the decoupled BLS model clients call.

text (+ reference audio or codes + transcript) -> prompt -> `slow_ar` stream of frames
-> chunks -> `dac_decoder` (stateful per stream, so chunks join without seams) -> audio
responses, then one final response with stats. Each request runs on its own worker
thread; `execute` returns at once.
"""

import json
import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.config import S2Config
from s2tts.prompt import PromptBuilder
from s2tts.sampling import SamplingParams
from s2tts.service import Limits, Stats, TTSRequest

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Cancelled(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        self.log = tu.setup_logging("s2pro")
        ckpt = tu.get_param(cfg, "checkpoint")
        if not ckpt:
            raise ValueError("s2pro: set the `checkpoint` parameter in config.pbtxt (an S2 Pro checkpoint directory)")
        self.s2 = S2Config.from_dir(ckpt)
        self.prompts = PromptBuilder.from_dir(ckpt, self.s2)
        d = Limits()
        self.limits = Limits(
            max_text_chars=tu.get_param(cfg, "max_text_chars", int, d.max_text_chars),
            max_reference_seconds=tu.get_param(cfg, "max_reference_seconds", float, d.max_reference_seconds),
            max_new_tokens=tu.get_param(cfg, "max_new_tokens_limit", int, d.max_new_tokens),
            default_max_new_tokens=tu.get_param(cfg, "default_max_new_tokens", int, d.default_max_new_tokens),
            default_first_chunk_frames=tu.get_param(cfg, "first_chunk_frames", int, d.default_first_chunk_frames),
            default_chunk_frames=tu.get_param(cfg, "chunk_frames", int, d.default_chunk_frames),
        )
        workers = tu.get_param(cfg, "max_concurrent_requests", int, 64)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="s2pro")
        self.live = 0
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                req = self._parse(request)
            except (ValueError, UnicodeDecodeError) as e:
                sender.send(tu.error_response(str(e)), flags=FINAL)
                continue
            self.pool.submit(self._serve, req, sender)
        return None

    def _parse(self, request) -> TTSRequest:
        L = self.limits
        audio = tu.optional_input(request, "reference_audio")
        codes = tu.optional_input(request, "reference_codes")
        seed = tu.scalar(request, "seed", int, -1)
        ref_text = tu.scalar(request, "reference_text", str, None)
        req = TTSRequest(
            text=tu.scalar(request, "text", str, ""),
            params=SamplingParams(
                temperature=tu.scalar(request, "temperature", float, 0.8),
                top_p=tu.scalar(request, "top_p", float, 0.8),
                top_k=tu.scalar(request, "top_k", int, 30),
                max_new_tokens=tu.scalar(request, "max_new_tokens", int, L.default_max_new_tokens),
                seed=random.getrandbits(63) if seed < 0 else seed,
                ignore_end=tu.scalar(request, "ignore_eos", bool, False),
            ),
            first_chunk_frames=tu.scalar(request, "first_chunk_frames", int, L.default_first_chunk_frames),
            chunk_frames=tu.scalar(request, "chunk_frames", int, L.default_chunk_frames),
            reference_audio=None if audio is None else audio.astype(np.float32).reshape(-1),
            reference_sample_rate=tu.scalar(request, "reference_sample_rate", int, None),
            reference_text=ref_text,
            reference_codes=None if codes is None else codes.astype(np.int64),
        )
        return req.validate(L, self.s2.num_codebooks)

    # ---- one request, on a worker thread ------------------------------------------------
    def _serve(self, req: TTSRequest, sender):
        stats = Stats(seed=req.params.seed)
        sid = uuid.uuid4().hex
        seq = 0
        decoder_open = False
        try:
            ref_codes = req.reference_codes
            if req.reference_audio is not None:
                ref_codes = self._encode(req.reference_audio, req.reference_sample_rate)
            prompt = self.prompts.build(req.text, ref_codes, req.reference_text)
            stats.prompt_tokens = len(prompt)
            responses = self._start_generation(sid, prompt, req)
            for frames, reason in self._frames(responses):
                if sender.is_cancelled():
                    self._cancel_engine(sid, responses)
                    raise Cancelled()
                stats.frames += frames.shape[0]
                if reason:
                    stats.finish_reason = reason
                if frames.shape[0]:  # slow_ar groups the frames into our chunks: one response, one chunk
                    chunk = frames.T
                    audio = self._decode(sid, chunk, final=bool(reason))
                    decoder_open = not reason
                    stats.audio_sent(audio.size)
                    sender.send(self._audio_response(audio, chunk, seq))
                    seq += 1
            if decoder_open:
                self._decode(sid, np.zeros((self.s2.num_codebooks, 0), np.int32), True)
                decoder_open = False
            sender.send(self._final_response(stats, seq), flags=FINAL)
        except Cancelled:
            stats.finish_reason = "cancelled"
            self._close_decoder(sid, decoder_open)
            self.log.info("s2pro: request cancelled by the client after %d frames", stats.frames)
            sender.send(self._final_response(stats, seq), flags=FINAL)
        except ValueError as e:
            self._close_decoder(sid, decoder_open)
            sender.send(tu.error_response(str(e)), flags=FINAL)
        except Exception as e:
            self.log.exception("s2pro: request failed")
            self._close_decoder(sid, decoder_open)
            sender.send(tu.error_response(f"{e}", "INTERNAL"), flags=FINAL)

    def _close_decoder(self, sid, is_open):
        if is_open:
            try:
                self._decode(sid, np.zeros((self.s2.num_codebooks, 0), np.int32), True)
            except Exception:
                self.log.exception("s2pro: could not release decoder state")

    def _encode(self, audio, sr):
        req = pb_utils.InferenceRequest(
            model_name="dac_encoder", requested_output_names=["codes"],
            inputs=[tu.tensor("waveform", audio.astype(np.float32)), tu.tensor("sample_rate", np.array([sr], np.int32))])
        resp = req.exec()
        if resp.has_error():
            raise ValueError(f"reference_audio could not be encoded: {resp.error().message()}")
        return pb_utils.get_output_tensor_by_name(resp, "codes").as_numpy().astype(np.int64)

    def _start_generation(self, sid, prompt, req: TTSRequest):
        """The slow_ar stream of this request (an iterator of responses), frames grouped as our chunks."""
        params = req.params
        inputs = [
            tu.string_tensor("request_id", sid),
            tu.tensor("input_ids", prompt.tokens.numpy().astype(np.int32)),
            tu.tensor("input_codes", prompt.codes.numpy().T.astype(np.int32)),
            tu.tensor("semantic_mask", prompt.semantic.numpy()),
            tu.tensor("prefix_len", np.array([prompt.prefix_len], np.int32)),
            tu.tensor("seed", np.array([params.seed], np.int64)),
            tu.tensor("temperature", np.array([params.temperature], np.float32)),
            tu.tensor("top_p", np.array([params.top_p], np.float32)),
            tu.tensor("top_k", np.array([params.top_k], np.int32)),
            tu.tensor("max_new_tokens", np.array([params.max_new_tokens], np.int32)),
            tu.tensor("ignore_eos", np.array([params.ignore_end])),
            tu.tensor("first_chunk_frames", np.array([req.first_chunk_frames], np.int32)),
            tu.tensor("chunk_frames", np.array([req.chunk_frames], np.int32)),
        ]
        req = pb_utils.InferenceRequest(model_name="slow_ar", inputs=inputs, requested_output_names=["codes", "finish_reason"])
        return req.exec(decoupled=True)

    def _frames(self, responses):
        """(frames [n, C], finish reason or "") per slow_ar response."""
        for resp in responses:
            if resp.has_error():
                msg = resp.error().message()
                raise (ValueError if "limit" in msg or "must" in msg else RuntimeError)(msg)
            codes = pb_utils.get_output_tensor_by_name(resp, "codes")
            if codes is None:  # the empty final response of the stream
                continue
            reason = pb_utils.get_output_tensor_by_name(resp, "finish_reason").as_numpy().reshape(-1)[0]
            reason = reason.decode() if isinstance(reason, bytes) else str(reason)
            yield codes.as_numpy().reshape(-1, self.s2.num_codebooks), reason

    def _cancel_engine(self, sid, responses):
        """Ask slow_ar to drop the request, then read its stream to the end (its final response), so
        that no BLS stream is left open in this process."""
        req = pb_utils.InferenceRequest(model_name="slow_ar", requested_output_names=[],
                                        inputs=[tu.string_tensor("request_id", sid), tu.tensor("cancel", np.array([True]))])
        for _ in req.exec(decoupled=True):
            pass
        for _ in responses:
            pass

    def _decode(self, sid, chunk, final: bool) -> np.ndarray:
        req = pb_utils.InferenceRequest(
            model_name="dac_decoder", requested_output_names=["audio"],
            inputs=[tu.tensor("codes", chunk[None].astype(np.int32)),
                    tu.tensor("stream_id", np.array([[sid.encode()]], dtype=object)),
                    tu.tensor("final", np.array([[final]], dtype=bool))])
        resp = req.exec()
        if resp.has_error():
            raise RuntimeError(f"dac_decoder: {resp.error().message()}")
        return pb_utils.get_output_tensor_by_name(resp, "audio").as_numpy().reshape(-1)

    def _audio_response(self, audio, chunk, seq):
        return pb_utils.InferenceResponse(output_tensors=[
            tu.tensor("audio", audio.astype(np.float32)),
            tu.tensor("codes", chunk.T.astype(np.int32)),
            tu.tensor("sequence", np.array([seq], np.int64)),
            tu.tensor("sample_rate", np.array([self.s2.sample_rate], np.int32)),
            tu.string_tensor("stats", ""),
        ])

    def _final_response(self, stats, seq):
        return pb_utils.InferenceResponse(output_tensors=[
            tu.tensor("audio", np.zeros(0, np.float32)),
            tu.tensor("codes", np.zeros((0, self.s2.num_codebooks), np.int32)),
            tu.tensor("sequence", np.array([seq], np.int64)),
            tu.tensor("sample_rate", np.array([self.s2.sample_rate], np.int32)),
            tu.string_tensor("stats", stats.to_json(self.s2.sample_rate)),
        ])

    def finalize(self):
        self.pool.shutdown(wait=False, cancel_futures=True)
