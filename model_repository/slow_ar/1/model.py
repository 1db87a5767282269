"""slow_ar: the decoupled continuous-batching AR engine (slow AR + fast AR per frame).

A thin adapter over `s2tts.engine.Engine`: `execute` only parses and submits; one
engine thread runs batched steps for all live requests; a second thread sends each
request's frames (grouped as the request asked: `first_chunk_frames`, then
`chunk_frames`, so a stream costs one response per audio chunk, not one per frame; the
split depends only on the request, so identical requests give identical audio bytes)
and polls for cancellation, so that IPC never stalls the GPU loop. Per-request state
lives in the engine and in `self.streams`, keyed by the request id.
"""

import json
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.checkpoint import codec_codebook_sizes, load_model
from s2tts.engine import Engine, FINISH_ERROR, HostFastAR
from s2tts.prompt import Prompt
from s2tts.sampling import SamplingParams
from s2tts.service import Chunker

CANCEL_POLL_S = 0.05
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class Stream:
    sender: object
    chunker: Chunker


class BLSFastAR(HostFastAR):
    """Calls the `fast_ar` model through BLS instead of running the module in this process."""

    def __call__(self, hidden, code0, temperature, top_p, top_k, seed, step):
        import torch

        arrays = {"hidden": hidden.float(), "code0": code0.int(), "temperature": temperature, "top_p": top_p,
                  "top_k": top_k.int(), "seed": seed, "step": step}
        inputs = [tu.tensor(k, v.cpu().numpy()) for k, v in arrays.items()]
        resp = pb_utils.InferenceRequest(model_name="fast_ar", inputs=inputs, requested_output_names=["codes"]).exec()
        if resp.has_error():
            raise RuntimeError(f"fast_ar: {resp.error().message()}")
        codes = pb_utils.get_output_tensor_by_name(resp, "codes").as_numpy()
        return torch.from_numpy(codes).to(device=hidden.device, dtype=torch.int64)


class TritonPythonModel:
    def initialize(self, args):
        import torch

        cfg = json.loads(args["model_config"])
        self.log = tu.setup_logging("slow_ar")
        ckpt = tu.get_param(cfg, "checkpoint")
        if not ckpt:
            raise ValueError("slow_ar: set the `checkpoint` parameter in config.pbtxt (an S2 Pro checkpoint directory)")
        mode = tu.get_param(cfg, "fast_ar", str, "inprocess")
        if mode not in ("inprocess", "bls"):
            raise ValueError(f"slow_ar: parameter fast_ar={mode!r}: use inprocess or bls")
        model = load_model(ckpt, tu.get_param(cfg, "device", str, "auto"), tu.get_param(cfg, "dtype", str, "bf16"))
        self.engine = Engine(
            model,
            residual_size=codec_codebook_sizes(ckpt)[1],
            max_batch=tu.get_param(cfg, "max_batch", int, 8),
            max_seq_len=tu.get_param(cfg, "max_seq_len", int, 4096),
            fast_ar=BLSFastAR() if mode == "bls" else None,
            prefix_cache_bytes=tu.get_param(cfg, "prefix_cache_mb", int, 512) << 20,
            max_prefill_tokens=tu.get_param(cfg, "max_prefill_tokens", int, 4096),
            cuda_graphs=tu.get_param(cfg, "cuda_graphs", bool, None),
        )
        self.C = model.s2.num_codebooks
        self.torch = torch
        self.streams: dict[str, Stream] = {}  # request id -> its sender and frame grouping
        self.lock = threading.Lock()
        self.outbox: queue.Queue = queue.Queue()  # (request id, response | None, flags)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="s2tts-engine", daemon=True)
        self.sender_thread = threading.Thread(target=self._send_loop, name="s2tts-sender", daemon=True)
        self.thread.start()
        self.sender_thread.start()
        self.log.info("slow_ar ready: device=%s dtype=%s max_batch=%d max_seq_len=%d cuda_graphs=%s prefix_cache=%d MiB",
                      self.engine.device, self.engine.dtype, self.engine.max_batch, self.engine.max_seq_len,
                      sorted(self.engine.graphs), self.engine.prefix_cache.max_bytes >> 20)

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                rid = tu.scalar(request, "request_id", str, "") or request.request_id() or f"r{id(request)}"
                if tu.scalar(request, "cancel", bool, False):
                    self.engine.cancel(rid)
                    sender.send(flags=FINAL)
                    continue
                prompt, params = self._parse(request)
                first = tu.scalar(request, "first_chunk_frames", int, 1)
                size = tu.scalar(request, "chunk_frames", int, 1)
                if first < 1 or size < 1:
                    raise tu.BadInput("first_chunk_frames and chunk_frames must be at least 1")
                with self.lock:
                    self.streams[rid] = Stream(sender, Chunker(first, size))
                try:
                    self.engine.submit(rid, prompt, params)
                except Exception:
                    with self.lock:
                        self.streams.pop(rid, None)
                    raise
            except (ValueError, tu.BadInput) as e:
                sender.send(tu.error_response(str(e)), flags=FINAL)
            except Exception as e:  # never let one request take the server down
                self.log.exception("slow_ar: request failed")
                sender.send(tu.error_response(f"internal error: {e}", "INTERNAL"), flags=FINAL)
        return None

    def _parse(self, request):
        torch = self.torch
        ids = tu.optional_input(request, "input_ids")
        codes = tu.optional_input(request, "input_codes")
        mask = tu.optional_input(request, "semantic_mask")
        if ids is None or ids.size == 0:
            raise tu.BadInput("input_ids is empty")
        ids = ids.reshape(-1).astype(np.int64)
        T = ids.shape[0]
        if codes is None:
            codes = np.zeros((self.C, T), dtype=np.int64)
        if mask is None:
            mask = np.zeros(T, dtype=bool)
        if codes.shape != (self.C, T) or mask.reshape(-1).shape != (T,):
            raise tu.BadInput(f"input_codes must be [{self.C}, {T}] and semantic_mask [{T}]")
        prefix_len = tu.scalar(request, "prefix_len", int, 0)
        if not (0 <= prefix_len <= T):
            raise tu.BadInput(f"prefix_len must be between 0 and {T}")
        prompt = Prompt(torch.from_numpy(ids), torch.from_numpy(codes.astype(np.int64).T.copy()),
                        torch.from_numpy(mask.reshape(-1).astype(bool)), prefix_len)
        seed = tu.scalar(request, "seed", int, -1)
        params = SamplingParams(
            temperature=tu.scalar(request, "temperature", float, 0.8),
            top_p=tu.scalar(request, "top_p", float, 0.8),
            top_k=tu.scalar(request, "top_k", int, 30),
            max_new_tokens=tu.scalar(request, "max_new_tokens", int, 1024),
            seed=None if seed < 0 else seed,
            ignore_end=tu.scalar(request, "ignore_eos", bool, False),
        )
        return prompt, params

    def _loop(self):
        """The GPU loop: engine steps, outputs grouped and queued for the sender thread."""
        while not self.stop.is_set():
            if not self.engine.wait_for_work(timeout=0.5):
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:
                self.log.exception("slow_ar: engine step failed; failing the live requests")
                outputs = self.engine.fail_all(str(e))
            for o in outputs:
                self._queue(o)

    def _queue(self, o):
        with self.lock:
            st = self.streams.get(o.request_id)
            if o.finished:
                self.streams.pop(o.request_id, None)
        if st is None:
            return
        if o.finish_reason == FINISH_ERROR:
            self.outbox.put((o.request_id, st.sender, tu.error_response(o.error or "engine error", "INTERNAL"), FINAL))
            return
        for chunk in st.chunker.add(o.codes):
            self.outbox.put((o.request_id, st.sender, self._response(chunk.T, ""), 0))
        if o.finished:
            tail = st.chunker.flush()
            codes = tail.T if tail is not None else np.zeros((0, self.C), np.int32)
            self.outbox.put((o.request_id, st.sender, self._response(codes, o.finish_reason), FINAL))
            self.log.info("slow_ar: request %s done, finish reason %s", o.request_id, o.finish_reason)

    @staticmethod
    def _response(codes, reason):
        return pb_utils.InferenceResponse(output_tensors=[tu.tensor("codes", np.ascontiguousarray(codes, dtype=np.int32)),
                                                         tu.string_tensor("finish_reason", reason)])

    def _send_loop(self):
        """Sends queued responses in order; between them, polls the live requests for cancellation."""
        last_poll = 0.0
        while not self.stop.is_set():
            try:
                rid, sender, resp, flags = self.outbox.get(timeout=CANCEL_POLL_S)
                try:
                    sender.send(resp, flags=flags)
                except Exception:  # the client went away
                    if not flags:
                        self.engine.cancel(rid)
            except queue.Empty:
                pass
            now = time.monotonic()
            if now - last_poll > CANCEL_POLL_S:
                last_poll = now
                with self.lock:
                    live = list(self.streams.items())
                for rid, st in live:
                    if st.sender.is_cancelled():
                        self.engine.cancel(rid)

    def finalize(self):
        self.stop.set()
        self.engine.wake()
        self.thread.join(timeout=5)
        self.sender_thread.join(timeout=5)
        with self.lock:
            streams, self.streams = self.streams, {}
        for st in streams.values():
            try:
                st.sender.send(tu.error_response("server shutting down", "UNAVAILABLE"), flags=FINAL)
            except Exception:
                pass
