"""slow_ar: the decoupled continuous-batching AR engine (slow AR + fast AR per frame).

A thin adapter over `s2tts.engine.Engine`: `execute` only parses and submits; one
engine thread runs batched steps for all live requests and streams each request's
frames of codes as they are made. Per-request state lives in the engine, keyed by
the request id.
"""

import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from s2tts import triton_utils as tu
from s2tts.checkpoint import codec_codebook_sizes, load_model
from s2tts.engine import Engine, FINISH_ERROR, HostFastAR
from s2tts.prompt import Prompt
from s2tts.sampling import SamplingParams

CANCEL_POLL_S = 0.02


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
        self.senders = {}  # request id -> response sender
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="s2tts-engine", daemon=True)
        self.thread.start()
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
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    continue
                prompt, params = self._parse(request)
                with self.lock:
                    self.senders[rid] = sender
                try:
                    self.engine.submit(rid, prompt, params)
                except Exception:
                    with self.lock:
                        self.senders.pop(rid, None)
                    raise
            except (ValueError, tu.BadInput) as e:
                sender.send(tu.error_response(str(e)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as e:  # never let one request take the server down
                self.log.exception("slow_ar: request failed")
                sender.send(tu.error_response(f"internal error: {e}", "INTERNAL"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
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
        last_poll = 0.0
        while not self.stop.is_set():
            if not self.engine.wait_for_work(timeout=0.5):
                continue
            now = time.monotonic()
            if now - last_poll > CANCEL_POLL_S:
                last_poll = now
                with self.lock:
                    cancelled = [rid for rid, s in self.senders.items() if s.is_cancelled()]
                for rid in cancelled:
                    self.engine.cancel(rid)
            try:
                outputs = self.engine.step()
            except Exception as e:
                self.log.exception("slow_ar: engine step failed; failing the live requests")
                outputs = self.engine.fail_all(str(e))
            for o in outputs:
                self._send(o)

    def _send(self, o):
        with self.lock:
            sender = self.senders.get(o.request_id)
            if o.finished:
                self.senders.pop(o.request_id, None)
        if sender is None:
            return
        if o.finished:
            self.log.info("slow_ar: request %s done, finish reason %s", o.request_id, o.finish_reason)
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if o.finished else 0
        if o.finish_reason == FINISH_ERROR:
            sender.send(tu.error_response(o.error or "engine error", "INTERNAL"), flags=flags)
            return
        tensors = [tu.tensor("codes", o.codes.astype(np.int32)),
                   tu.string_tensor("finish_reason", o.finish_reason or "")]
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        except Exception:  # the client went away
            if not o.finished:
                self.engine.cancel(o.request_id)

    def finalize(self):
        self.stop.set()
        self.engine.wake()
        self.thread.join(timeout=5)
        with self.lock:
            senders, self.senders = self.senders, {}
        for s in senders.values():
            try:
                s.send(tu.error_response("server shutting down", "UNAVAILABLE"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pass
