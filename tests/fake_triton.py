"""A stand-in for Triton's Python backend that runs the real `model.py` files in this process.

`FakeTriton(repo)` loads models from a rendered model repository; BLS calls between them
(`pb_utils.InferenceRequest(...).exec()`) are routed in-process, decoupled ones through
response senders as in Triton. Senders enforce Triton's rules (nothing after the final
response) and record everything, so tests can assert that each request got exactly one
final response. `unload_model` / `load_model` / `is_model_ready` act on the fake server.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import sys
import threading
import types
from pathlib import Path

import numpy as np

FINAL = 1


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message, code=1):
        self._message, self._code = message, code

    def message(self):
        return self._message

    def code(self):
        return self._code


class Tensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self._outputs = list(output_tensors or [])
        self._error = error

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def get(self, name):
        t = next((t for t in self._outputs if t.name() == name), None)
        return None if t is None else t.as_numpy()


def get_input_tensor_by_name(request, name):
    return request._inputs.get(name)


def get_output_tensor_by_name(response, name):
    return next((t for t in response.output_tensors() if t.name() == name), None)


class SenderClosed(RuntimeError):
    pass


class Sender:
    """Records what a request was answered; raises like Triton on a send after the final response."""

    def __init__(self, request):
        self.request = request
        self.responses: list[InferenceResponse] = []
        self.finals = 0
        self.late = 0  # sends attempted after the final response
        self.q: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.muted = None  # () -> True once the model instance that answers it was killed (FakeTriton.kill)

    def send(self, response=None, flags=0):
        if self.muted is not None and self.muted():  # its model's process was killed: nothing leaves it any more
            return
        with self._lock:
            if self.finals:
                self.late += 1
                raise SenderClosed("Unable to send response. Response sender has been closed.")
            if response is not None:
                self.responses.append(response)
            if flags & FINAL:
                self.finals += 1
        self.q.put((response, bool(flags & FINAL)))
        if flags & FINAL:
            self.done.set()

    def is_cancelled(self):
        return self.request.cancelled

    @property
    def error(self):
        errs = [r.error() for r in self.responses if r.has_error()]
        return errs[-1] if errs else None


class Request:
    def __init__(self, inputs: dict, request_id: str = ""):
        self._inputs = {k: v if isinstance(v, Tensor) else Tensor(k, v) for k, v in inputs.items()}
        self._request_id = request_id
        self.cancelled = False
        self.sender = Sender(self)

    def get_response_sender(self):
        return self.sender

    def request_id(self):
        return self._request_id

    def is_cancelled(self):
        return self.cancelled


class ResponseIterator:
    def __init__(self, sender: Sender):
        self.sender = sender

    def __iter__(self):
        return self

    def __next__(self):
        if self.sender.done.is_set() and self.sender.q.empty():
            raise StopIteration
        resp, final = self.sender.q.get()
        if resp is None and final:
            raise StopIteration
        if final:
            self.sender.done.set()
        return resp


class FakeTriton:
    def __init__(self, repo: str | Path, models=None):
        """`models`: default the pipeline's (s2pro, slow_ar, dac_encoder, dac_decoder, and their replicas)."""
        self.repo = Path(repo)
        if models is None:
            from s2tts.layout import role_of

            models = [m for m in ("s2pro", "slow_ar", "dac_encoder", "dac_decoder") if (self.repo / m).is_dir()]
            models += sorted(p.name for p in self.repo.iterdir() if p.is_dir() and role_of(p.name) != p.name)
        self.models: dict[str, object] = {}
        self.instances: dict[str, list] = {}  # every instance of a model (`instance_group` count); models: the first
        self.turn: dict[str, int] = {}  # the instance the next request goes to (in turn, or `request(instance=k)`)
        self.decoupled: dict[str, bool] = {}
        self.calls: list[tuple[str, str]] = []  # (model, what) for load/unload
        self.dead: set[str] = set()  # models whose "process" is gone: BLS calls fail as in Triton
        self.hang: set[str] = set()  # dead models whose in-flight streams never end (as with a killed stub)
        self.killed: set[int] = set()  # id() of the model instances killed: their senders send nothing more
        self._install()
        for m in models:
            self.load(m)

    # ---- the fake triton_python_backend_utils module -----------------------------------------
    def _install(self):
        mod = types.ModuleType("triton_python_backend_utils")
        mod.TritonError, mod.Tensor, mod.InferenceResponse = TritonError, Tensor, InferenceResponse
        mod.get_input_tensor_by_name, mod.get_output_tensor_by_name = get_input_tensor_by_name, get_output_tensor_by_name
        mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
        harness = self

        class InferenceRequest:
            def __init__(self, model_name, inputs, requested_output_names, request_id="", **kw):
                self.model_name, self.inputs, self.request_id = model_name, inputs, request_id

            def exec(self, decoupled=False):
                return harness.bls(self.model_name, {t.name(): t for t in self.inputs}, self.request_id, decoupled)

        mod.InferenceRequest = InferenceRequest
        mod.is_model_ready = lambda model_name, model_version="": model_name in self.models and model_name not in self.dead
        mod.unload_model = lambda model_name, unload_dependents=False: self.unload(model_name)
        mod.load_model = lambda model_name, config="", files=None: self.load(model_name)
        sys.modules["triton_python_backend_utils"] = mod
        self.pb = mod

    # ---- models ------------------------------------------------------------------------------
    def _config(self, name: str) -> dict:
        from google.protobuf import json_format

        from s2tts.repository import parse_model_config

        cfg = parse_model_config(self.repo / name / "config.pbtxt")
        return json_format.MessageToDict(cfg, preserving_proto_field_name=True)

    def load(self, name: str):
        self.calls.append((name, "load"))
        cfg = self._config(name)
        path = self.repo / name / "1" / "model.py"
        spec = importlib.util.spec_from_file_location(f"fake_triton_{name}_{len(self.calls)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        count = int((cfg.get("instance_group") or [{}])[0].get("count", 1))
        instances = []
        for k in range(count):  # as Triton: each instance its own model object (there, its own process)
            model = module.TritonPythonModel()
            model.initialize({"model_config": json.dumps(cfg), "model_name": name, "model_instance_kind": "CPU",
                              "model_repository": str(self.repo / name), "model_instance_name": f"{name}_{k}"})
            instances.append(model)
        self.models[name] = instances[0]
        self.instances[name] = instances
        self.turn[name] = 0
        self.decoupled[name] = bool(cfg.get("model_transaction_policy", {}).get("decoupled"))
        self.dead.discard(name)
        self.hang.discard(name)

    def unload(self, name: str):
        self.calls.append((name, "unload"))
        self.models.pop(name, None)
        for model in self.instances.pop(name, []):
            if name not in self.dead:
                threading.Thread(target=getattr(model, "finalize", lambda: None), daemon=True).start()
        self.dead.discard(name)

    def kill(self, name: str):
        """As a killed stub process: the model never answers again; new calls fail at once."""
        self.dead.add(name)
        self.hang.add(name)
        for model in self.instances[name]:
            self.killed.add(id(model))
            for attr in ("service",):  # stop its threads without any final response (a dead process sends nothing)
                svc = getattr(model, attr, None)
                if svc is not None:
                    svc.stop.set()

    # ---- calls -------------------------------------------------------------------------------
    def request(self, model: str, inputs: dict, request_id: str = "", instance: int | None = None) -> Request:
        """A client request to `model` (as over gRPC): returns the Request, whose sender records the answers. A
        model of several instances gets requests in turn, or on `instance`."""
        req = Request(inputs, request_id)
        if model in self.dead or model not in self.models:
            msg = f"Stub process '{model}_0_0' is not healthy." if model in self.dead else \
                f"Request for unknown model: '{model}' is not found"
            req.sender.send(InferenceResponse(error=TritonError(msg, TritonError.INTERNAL)), FINAL)
            return req
        group = self.instances[model]
        if instance is None:
            instance, self.turn[model] = self.turn[model] % len(group), self.turn[model] + 1
        inst = group[instance]
        req.sender.muted = lambda: id(inst) in self.killed  # a killed process answers nothing, not even what it had
        out = inst.execute([req])
        if out is not None:  # a non-decoupled model answers from execute
            for resp in out:
                req.sender.send(resp, FINAL)
        return req

    def bls(self, model: str, inputs: dict, request_id: str, decoupled: bool):
        req = self.request(model, inputs, request_id)
        if decoupled:
            return ResponseIterator(req.sender)
        resp, _final = req.sender.q.get()
        return resp

    def shutdown(self):
        for name in list(self.models):
            self.models.pop(name)
            for model in self.instances.pop(name, []):
                if name not in self.dead:
                    getattr(model, "finalize", lambda: None)()


# ---- helpers for tests that run the repository on the fake --------------------------------------
def render(tiny_ckpt, workdir, **settings) -> Path:
    """The model repository on the tiny checkpoint (CPU, fp32; short stall checks) under `workdir`."""
    from s2tts.repository import render_repository

    base = {"checkpoint": str(tiny_ckpt), "device": "cpu", "dtype": "fp32", "max_batch": "4", "max_seq_len": "4096",
            "chunk_frames": "4", "first_chunk_frames": "2", "stall_timeout_s": "1", "request_timeout_s": "60"}
    base.update({k: str(v) for k, v in settings.items()})
    return render_repository(Path(workdir) / "repo", base)


def tts_inputs(text="Hello there.", seed=1, max_new_tokens=12, **kw) -> dict:
    """s2pro's inputs for one request."""
    inputs = {"text": np.array([text.encode()], dtype=object), "seed": np.array([seed], np.int64),
              "max_new_tokens": np.array([max_new_tokens], np.int32)}
    inputs.update(kw)
    return inputs


def slow_ar_inputs(h: FakeTriton, text="Pulled a chunk at a time.", **kw) -> dict:
    """A slow_ar generation request's inputs (the prompt s2pro would build for `text`; 2-then-4-frame chunks, a
    seeded 40 frames with no end token unless `kw` says otherwise)."""
    prompt = h.models["s2pro"].service.prompts.build(text)
    base = {"input_ids": prompt.tokens.numpy().astype(np.int32), "input_codes": prompt.codes.numpy().astype(np.int32),
            "semantic_mask": prompt.semantic.numpy(), "max_new_tokens": np.array([40], np.int32),
            "ignore_eos": np.array([True]), "seed": np.array([3], np.int64), "first_chunk_frames": np.array([2], np.int32),
            "chunk_frames": np.array([4], np.int32)}
    return {**base, **kw}


def wait_final(req: Request, timeout=60) -> Request:
    assert req.sender.done.wait(timeout), "no final response"
    return req


def one_final(req: Request):
    """Exactly one final response and nothing after it; returns its error (None if it succeeded)."""
    s = req.sender
    assert s.finals == 1 and s.late == 0, (s.finals, s.late)
    return s.error


def quiet(h: FakeTriton, timeout=30) -> dict:
    """Everything released: no request in any table, every KV slot free, no codec state."""
    import time

    deadline = time.time() + timeout
    s2 = h.models["s2pro"].service
    # the engine: slow_ar's, or the one s2pro holds (engine_in_s2pro), which has no pull streams
    slow = h.models["slow_ar"].service if "slow_ar" in h.models else h.models["s2pro"].downstream.services["slow_ar"]
    dec = h.models["dac_decoder"].decoder
    while time.time() < deadline:
        counts = slow.engine.counts()
        streams = h.models["slow_ar"].streams.sweep() if "slow_ar" in h.models else 0
        codec_states = [*(dec.states if dec is not None else ()), *(slow.codec.states if slow.codec is not None else ())]
        if not len(slow.table) and not len(s2.table) and counts["live"] == counts["waiting"] == 0 and not codec_states \
                and not streams:
            return counts
        time.sleep(0.05)
    raise AssertionError(f"not released: slow_ar {slow.status()} ({streams} streams), s2pro {s2.status()}, "
                         f"codec {codec_states}")
