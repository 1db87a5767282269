"""How Triton's first compiles of many kernel variants go: one after another, on threads, in processes (a GPU).

    python3 perf/compile_probe.py --n 16 --workers 8

Compiles `--n` variants of one matrix-product kernel (a constexpr apart) each way, into a fresh cache, and prints the
seconds each way took, and the main process's time for the variants the processes compiled (their cache's reuse)."""
import argparse, json, os, tempfile, time
from concurrent.futures import ThreadPoolExecutor, ProcessPoolExecutor
import multiprocessing as mp


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def mm(A, B, C, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, V: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        acc = tl.zeros((BM, BN), tl.float32)
        for k in range(0, K, BK):
            rk = k + tl.arange(0, BK)
            a = tl.load(A + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            b = tl.load(B + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
            acc += tl.dot(a, b)
        acc = acc * (1.0 + V * 1e-9)
        tl.store(C + rm[:, None] * N + rn[None, :], acc.to(C.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))
    return mm


def compile_one(v):
    import torch
    mm = _kernel()
    a = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    b = torch.randn(256, 256, device="cuda", dtype=torch.float16)
    c = torch.empty(256, 256, device="cuda", dtype=torch.float16)
    t = time.perf_counter()
    mm[(2, 2)](a, b, c, 256, 256, 256, BM=128, BN=128, BK=64, V=v)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    a = ap.parse_args()
    out = {}
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    compile_one(-1)  # the first one pays the imports and the driver's set-up
    t = time.perf_counter(); [compile_one(v) for v in range(a.n)]; out["serial_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with ThreadPoolExecutor(a.workers) as ex:
        list(ex.map(compile_one, range(100, 100 + a.n)))
    out["threads_s"] = time.perf_counter() - t
    t = time.perf_counter()
    with ProcessPoolExecutor(a.workers, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(compile_one, range(200, 200 + a.n)))
    out["processes_s"] = time.perf_counter() - t
    t = time.perf_counter(); [compile_one(v) for v in range(200, 200 + a.n)]; out["after_processes_main_s"] = time.perf_counter() - t
    out.update(n=a.n, workers=a.workers)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
