#!/usr/bin/env python3
"""Does this tritonserver's Python backend survive BLS calls from many threads of one model? (issue 9)

    python perf/bls_race.py --mode decoupled   # the pattern s2pro used: a decoupled BLS stream per request
    python perf/bls_race.py --mode pull        # what it uses now: request-response BLS calls only

Serves two throwaway models: `burst` answers each request from a thread of its own (as slow_ar does), and
`caller` starts `--threads` threads that each make `--calls` BLS calls to it (`decoupled`: a stream of 5
responses each; `pull`: one request-response call each), touch every output and drop it. One client request
to `caller` per round, `--rounds` rounds. Prints the rounds survived and whether the caller's process died
(a segmentation fault) or stopped answering (a deadlock), and exits 1 then.

With Triton 24.10 (the nvidia-pytriton 0.7.0 wheel), on the 2-core CI machine: `decoupled` crashes in the
first round; `pull` ran 40 rounds of 8 x 900 calls (288,000 calls) clean. Why: perf/RESULTS.md, "The s2pro crash".
Run it again on any new Triton release before going back to decoupled BLS.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BURST = '''
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "n").as_numpy()[0])
            s = r.get_response_sender()
            threading.Thread(target=self.answer, args=(s, n), daemon=True).start()
        return None

    def answer(self, s, n):
        def resp(i):
            return pb_utils.InferenceResponse([pb_utils.Tensor("x", np.full(16, i, np.float32)),
                                               pb_utils.Tensor("s", np.array([b"a%d" % i, b"bb"], dtype=object))])
        if DECOUPLED:
            for i in range(n):
                s.send(resp(i))
            s.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            time.sleep(0.001 * (n % 3))
            s.send(resp(n), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

CALLER = '''
import faulthandler, threading
import numpy as np
import triton_python_backend_utils as pb_utils

faulthandler.enable()

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            count = [0]
            lock = threading.Lock()

            def work():
                junk = []
                for k in range(CALLS):
                    req = pb_utils.InferenceRequest(model_name="burst", requested_output_names=["x", "s"],
                                                    inputs=[pb_utils.Tensor("n", np.array([5 if DECOUPLED else k], np.int32))])
                    responses = req.exec(decoupled=True) if DECOUPLED else [req.exec()]
                    for resp in responses:
                        x = pb_utils.get_output_tensor_by_name(resp, "x")
                        if x is not None:
                            junk.append(x.as_numpy().sum())
                            junk.append({"a": [1, 2, 3], "b": "x" * 10})
                            pb_utils.get_output_tensor_by_name(resp, "s").as_numpy().tolist()
                        if len(junk) > 1000:
                            junk.clear()
                    del responses
                    with lock:
                        count[0] += 1

            threads = [threading.Thread(target=work) for _ in range(THREADS)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("done", np.array([count[0]], np.int64))]))
        return out
'''


def write_repo(root: Path, decoupled: bool, threads: int, calls: int) -> None:
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    consts = f"DECOUPLED = {decoupled}\nTHREADS = {threads}\nCALLS = {calls}\n"
    for name, code, cfg in (
        ("burst", BURST, f'''name: "burst"\nbackend: "python"\nmax_batch_size: 0\n{policy}
input [ {{ name: "n" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "x" data_type: TYPE_FP32 dims: [ -1 ] }}, {{ name: "s" data_type: TYPE_STRING dims: [ -1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]\n'''),
        ("caller", CALLER, '''name: "caller"\nbackend: "python"\nmax_batch_size: 0
input [ { name: "go" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "done" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]\n''')):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(cfg)
        (root / name / "1" / "model.py").write_text(consts + textwrap.dedent(code))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("decoupled", "pull"), required=True)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--calls", type=int, default=None, help="BLS calls per thread per round (default 150 decoupled, 900 pull)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--round-timeout", type=float, default=120.0, help="a round taking longer counts as a deadlock")
    a = ap.parse_args()

    import numpy as np
    import tritonclient.grpc as g

    from s2tts.server import backend_dir, find_server, free_port

    decoupled = a.mode == "decoupled"
    work = Path(tempfile.mkdtemp(prefix="bls-race-"))
    write_repo(work / "repo", decoupled, a.threads, a.calls or (150 if decoupled else 900))
    binary, _, libs = find_server()
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if libs:
        env["LD_LIBRARY_PATH"] = f"{libs}:{env.get('LD_LIBRARY_PATH', '')}"
    port = free_port()
    log_path = work / "tritonserver.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(binary), f"--model-repository={work / 'repo'}", f"--backend-directory={backend_dir(work)}",
                                 f"--grpc-port={port}", f"--http-port={free_port()}", f"--metrics-port={free_port()}",
                                 "--grpc-address=127.0.0.1", "--http-address=127.0.0.1", "--metrics-address=127.0.0.1",
                                 "--exit-timeout-secs=5"], env=env, stdout=log, stderr=subprocess.STDOUT)
    ok, verdict = 0, "survived"
    try:
        with g.InferenceServerClient(f"127.0.0.1:{port}") as c:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    if c.is_server_ready():
                        break
                except Exception:  # noqa: BLE001 - still starting
                    pass
                time.sleep(0.5)
            t0 = time.time()
            for i in range(a.rounds):
                go = g.InferInput("go", [1], "INT32")
                go.set_data_from_numpy(np.array([1], np.int32))
                try:
                    done = int(c.infer("caller", [go], client_timeout=a.round_timeout).as_numpy("done")[0])
                except g.InferenceServerException as e:
                    verdict = "deadlocked (no answer in time)" if "Deadline" in str(e) else f"failed: {str(e)[:160]}"
                    break
                ok += 1
                print(f"round {i}: {done} calls, {time.time() - t0:.1f} s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    crashes = log_path.read_text(errors="replace").count("Segmentation fault")
    print(f"mode={a.mode} threads={a.threads}: {ok}/{a.rounds} rounds, {verdict}; segmentation faults in the log: "
          f"{crashes} ({log_path})")
    return 0 if ok == a.rounds else 1


if __name__ == "__main__":
    sys.exit(main())
