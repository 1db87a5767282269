"""What a Python model's `response_sender.send` costs when another thread of its process runs Python: the question
behind slow_ar's sender thread beside its engine thread.

A toy decoupled model (written into a temporary repository, served by the real tritonserver `s2tts.server` finds)
sends `--sends` responses of `--samples` float32 samples to one gRPC stream, in three modes: alone; with a thread
beside it running pure Python (as the engine thread does between its device waits); and with that thread and the
interpreter's switch interval at `--interval-ms`. Per mode: the wall time of one send in the sending thread, and the
busy thread's pace against its pace alone (what the sends took from it; on a machine of few cores the server and the
client take CPU from it too). The client checks every response's content.

    python perf/send_probe.py [--sends 200] [--samples 16384] [--interval-ms 0.5] [--json out.json]

On the 2-core development machine (perf/RESULTS.md, 34th session) a send took 0.21-0.24 ms alone and 5.6-5.7 ms with
a busy thread beside it (the default 5 ms switch interval: the send gives up the interpreter and waits that long to get it
back), 0.9-1.0 ms with a 0.5 ms interval.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("alone", "busy thread beside", "busy thread, short switch interval")

CONFIG = """name: "send_probe"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "SENDS" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "SAMPLES" data_type: TYPE_INT32 dims: [ 1 ] },
        { name: "MODE" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "INTERVAL_S" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "AUDIO" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "TIMES" data_type: TYPE_FP64 dims: [ -1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

MODEL = '''
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


def _scalar(request, name):
    return pb_utils.get_input_tensor_by_name(request, name).as_numpy()[0]


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:  # each request served by a thread of its own, as slow_ar's sender serves its requests
            threading.Thread(target=self._serve, args=(r,), daemon=True).start()
        return None

    def _serve(self, request):
        sends, samples, mode = int(_scalar(request, "SENDS")), int(_scalar(request, "SAMPLES")), int(_scalar(request, "MODE"))
        sender = request.get_response_sender()
        before = sys.getswitchinterval()
        if mode == 2:
            sys.setswitchinterval(float(_scalar(request, "INTERVAL_S")))
        stop, counted = threading.Event(), [0]

        def busy():  # pure Python until told to stop
            n = 0
            while not stop.is_set():
                for _ in range(1000):
                    n += 1
            counted[0] = n

        thread = threading.Thread(target=busy) if mode else None
        audio = np.arange(samples, dtype=np.float32)
        t0 = time.perf_counter()
        if thread is not None:
            thread.start()
        if sends == 0:  # the busy thread's pace alone
            time.sleep(1.0)
        in_send = 0.0
        for i in range(sends):
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("AUDIO", audio + i), pb_utils.Tensor("TIMES", np.zeros(0, np.float64))])
            a = time.perf_counter()
            sender.send(response)
            in_send += time.perf_counter() - a
        wall = time.perf_counter() - t0
        interval = sys.getswitchinterval()
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(before)
        sender.send(pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("AUDIO", np.zeros(0, np.float32)),
            pb_utils.Tensor("TIMES", np.array([wall, in_send, counted[0] / wall, interval], np.float64))]),
            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


def probe(sends: int, samples: int, interval_ms: float, timeout: float = 120.0) -> list[dict]:
    """Serve the toy model and run each mode once (after the busy thread's pace alone); returns a row a mode."""
    import tritonclient.grpc as grpcclient

    from s2tts.server import TritonServer

    server = TritonServer(None)  # in a temporary folder of its own, removed when it stops
    model = server.workdir / "repo" / "send_probe"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(CONFIG)
    (model / "1" / "model.py").write_text(MODEL)
    try:
        server.start(timeout, repository=model.parent)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))

        def run(n: int, mode: int) -> tuple[float, float, float, float]:
            inputs = []
            for name, dtype, value in (("SENDS", np.int32, n), ("SAMPLES", np.int32, samples), ("MODE", np.int32, mode),
                                       ("INTERVAL_S", np.float32, interval_ms / 1e3)):
                x = grpcclient.InferInput(name, [1], "INT32" if dtype is np.int32 else "FP32")
                x.set_data_from_numpy(np.array([value], dtype))
                inputs.append(x)
            client.async_stream_infer("send_probe", inputs)
            for i in range(n + 1):
                result, error = answers.get(timeout=timeout)
                if error is not None:
                    raise RuntimeError(f"the probe model failed: {error}")
                audio = result.as_numpy("AUDIO")
                if i < n and not np.array_equal(audio, np.arange(samples, dtype=np.float32) + i):
                    raise AssertionError(f"response {i} of mode {mode} does not carry what was sent")
            wall, in_send, pace, interval = result.as_numpy("TIMES")
            return float(wall), float(in_send), float(pace), float(interval)

        alone_pace = run(0, 1)[2]
        rows = []
        for mode, name in enumerate(MODES):
            wall, in_send, pace, interval = run(sends, mode)
            rows.append({"mode": name, "sends": sends, "samples": samples, "interval_ms": round(interval * 1e3, 3),
                         "send_ms": round(1e3 * in_send / sends, 3), "wall_s": round(wall, 3),
                         "busy_pace": round(pace / alone_pace, 3) if mode else None})
        client.stop_stream()
        return rows
    finally:
        server.stop(timeout=10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sends", type=int, default=200)
    ap.add_argument("--samples", type=int, default=16384, help="float32 samples a response (16384: 8 frames of audio)")
    ap.add_argument("--interval-ms", type=float, default=0.5, help="the third mode's switch interval")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.sends < 1 or args.samples < 1 or args.interval_ms <= 0:
        ap.error("--sends and --samples must be at least 1, --interval-ms above 0")
    rows = probe(args.sends, args.samples, args.interval_ms)
    print("| mode | switch interval ms | sends | ms a send | the busy thread's pace (against alone) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['interval_ms']:g} | {r['sends']} | {r['send_ms']} | "
              f"{'-' if r['busy_pace'] is None else r['busy_pace']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
