"""The paged KV cache (s2tts/engine/paged.py) on the tiny checkpoint, fp32, CPU: the same logits and codes as the slot
layout, blocks allocated as requests grow and all given back (finish, cancel, error), voice prefixes shared by
reference, admission that waits for blocks, and preemption that resumes a request where it stopped."""

import numpy as np
import pytest
import torch

from s2tts.engine import FINISH_CANCELLED, FINISH_ERROR, Engine, EngineConfig
from s2tts.engine.paged import BlockPool
from s2tts.ar.sampling import SamplingParams

RESIDUAL = 32


@pytest.fixture(scope="module")
def requests(prompts):
    ref = torch.randint(0, 32, (10, 45), generator=torch.Generator().manual_seed(3))
    texts = ["Short one.", "A somewhat longer sentence to speak.", "Third, with a voice.", "Fourth, same voice."]
    built = [prompts.build(texts[0]), prompts.build(texts[1]), prompts.build(texts[2], ref, "Reference words."),
             prompts.build(texts[3], ref, "Reference words.")]
    # ignore_end + distinct lengths: every request crosses several block boundaries
    return [(f"r{i}", p, SamplingParams(seed=10 + i, max_new_tokens=12 + 5 * i, ignore_end=True))
            for i, p in enumerate(built)]


def _run(eng, reqs, stagger=True, on_step=None):
    """Submit (with `stagger`, one request per step) and step until done -> ({id: codes}, {id: [logits]},
    {id: reason})."""
    logits, codes, reasons = {}, {}, {}
    eng.logits_hook = lambda ids, lg: [logits.setdefault(i, []).append(lg[j].clone()) for j, i in enumerate(ids)]
    pending = list(reqs)
    while pending or eng.has_work():
        for rid, p, sp in (pending[:1] if stagger else pending):
            eng.submit(rid, p, sp)
        pending = pending[1:] if stagger else []
        for o in eng.step():
            codes.setdefault(o.request_id, []).append(o.codes)
            if o.finished:
                reasons[o.request_id] = o.finish_reason
        if on_step is not None:
            on_step(eng)
    return {k: np.concatenate(v) for k, v in codes.items()}, logits, reasons


def _engine(model, **kw):
    kw.setdefault("max_batch", 4)
    kw.setdefault("max_seq_len", 512)
    kw.setdefault("prefix_cache_mb", 64)
    return Engine(model, RESIDUAL, EngineConfig(**kw))


def _assert_same(a, b):
    (ca, la, _), (cb, lb, _) = a, b
    assert ca.keys() == cb.keys()
    for rid in ca:
        np.testing.assert_array_equal(ca[rid], cb[rid])
        assert len(la[rid]) == len(lb[rid])
        for x, y in zip(la[rid], lb[rid]):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_paged_cache_gives_the_slot_layouts_logits(model, requests):
    """Blocks of 8 and 32 positions against one block of max_seq_len per request (the slot layout): the same
    logits at every step and the same codes, with requests joining mid-run and a voice prefix cached."""
    slot = _run(_engine(model, kv_block_tokens=0), requests)
    for bs in (8, 32):
        eng = _engine(model, kv_block_tokens=bs)
        paged = _run(eng, requests)
        _assert_same(paged, slot)
        assert eng.prefix_cache.hits == 1
    assert {rid: len(c) for rid, c in slot[0].items()} == {rid: sp.max_new_tokens for rid, _, sp in requests}


def test_blocks_follow_each_requests_length_and_all_come_back(model, requests):
    eng = _engine(model, kv_block_tokens=8)
    pool = eng.blocks
    seen = []

    def check(e):
        for r in e.live.values():  # a request holds the blocks of the positions written so far, no more
            assert pool.holds(r.slot) == pool.blocks_for(max(r.length, 1)) or \
                pool.holds(r.slot) == pool.blocks_for(r.length + 1), (r.id, r.length, pool.holds(r.slot))
        held = sum(pool.holds(s) for s in e.live)
        seen.append(held)

    _run(eng, requests, on_step=check)
    assert max(seen) > min(seen) and max(seen) < pool.capacity  # grew and shrank, far below the pool
    # every block is free again except the cached voice prefix's (shared full blocks + a private partial copy)
    assert eng.counts()["live"] == 0 and pool.used == eng.prefix_cache.held > 0
    eng.prefix_cache.clear()
    assert pool.used == 0 and pool.free == pool.capacity and not any(pool.refs[1:])
    assert not pool.owned and int(abs(pool.table).sum()) == 0  # every table row points at the null block
    eng.runner.apply(pool)  # and so does the device's table
    assert int(eng.model.slow.stack.block_table.abs().sum()) == 0


@pytest.mark.parametrize("bs", [8, 12])  # the tiny voice prefix is 104 tokens: whole blocks of 8, 8 + a part of 12
def test_voice_prefix_blocks_are_shared_by_reference(model, requests, bs):
    eng = _engine(model, kv_block_tokens=bs, max_batch=2)
    (_, v1, sp1), (_, v2, sp2) = requests[2], requests[3]
    eng.generate(v1, sp1, request_id="v1")
    (entry,) = eng.prefix_cache.entries.values()
    full, part = divmod(v1.prefix_len, bs)
    assert full >= 5 and len(entry.blocks) == full + (part > 0)  # full blocks shared, a partial one copied
    shared = entry.blocks[:full]
    eng.submit("v2", v2, sp2)
    eng.step()  # admitted and prefilled from the cached prefix
    (r,) = eng.live.values()
    assert r.start == v1.prefix_len and eng.prefix_cache.hits == 1
    assert eng.blocks.owned[r.slot][:full] == shared  # the same physical blocks, not copies
    assert all(eng.blocks.refs[b] == 2 for b in shared)
    if part:
        assert eng.blocks.owned[r.slot][full] != entry.blocks[full]  # its own copy, which it writes on from there
    while eng.has_work():
        eng.step()
    assert all(eng.blocks.refs[b] == 1 for b in shared)  # the cache's reference is the one left


def test_cancel_and_errors_give_every_block_back(model, requests):
    eng = _engine(model, kv_block_tokens=8, prefix_cache_mb=0)
    for rid, p, sp in requests[:3]:
        eng.submit(rid, p, sp)
    for _ in range(4):
        eng.step()
    assert eng.blocks.used > 0
    eng.cancel("r1")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["r1"].finish_reason == FINISH_CANCELLED
    eng.fault_hook = lambda phase, reqs: (_ for _ in ()).throw(RuntimeError("injected")) if phase == "decode" else None
    outs = {o.request_id: o for o in eng.step()}
    eng.fault_hook = None
    assert {outs["r0"].finish_reason, outs["r2"].finish_reason} == {FINISH_ERROR}
    assert eng.counts()["live"] == 0 and eng.blocks.used == 0 and not any(eng.blocks.refs[1:])
    eng.submit("again", requests[3][1], requests[3][2])
    eng.fail_all("shutting down")
    assert eng.blocks.used == 0


def test_a_request_waits_for_blocks_then_runs(model, requests):
    """A pool that holds one request at a time (admission counts blocks, not just slots)."""
    (_, p0, sp0), (_, p1, sp1) = requests[0], requests[1]
    need = max(len(p0) + sp0.max_new_tokens, len(p1) + sp1.max_new_tokens)
    eng = _engine(model, kv_block_tokens=8, max_seq_len=need + 8, kv_cache_tokens=need + 8, prefix_cache_mb=0)
    eng.submit("a", p0, sp0)
    eng.step()
    eng.submit("b", p1, sp1)
    waited = 0
    done = {}
    while eng.has_work():
        c = eng.counts()
        waited += c["live"] == 1 and c["waiting"] == 1
        for o in eng.step():
            done.setdefault(o.request_id, []).append(o)
    assert waited > 0
    assert [o.finished for o in done["a"]][-1] and [o.finished for o in done["b"]][-1]
    assert sum(len(o.codes) for o in done["b"]) == sp1.max_new_tokens


def test_preempted_requests_resume_with_the_same_codes(model, requests):
    """A pool too small for all four requests to grow: the request admitted last is preempted (its blocks
    freed), resumes later from its prompt plus the frames it had made, and every request ends with the codes
    of an unhurried run."""
    big = _run(_engine(model, kv_block_tokens=8, prefix_cache_mb=0), requests, stagger=False)
    longest = max(len(p) + sp.max_new_tokens for _, p, sp in requests)
    eng = _engine(model, kv_block_tokens=8, max_seq_len=longest + 8, kv_cache_tokens=longest + 80,
                  prefix_cache_mb=0)
    small = _run(eng, requests, stagger=False)
    assert eng.preemptions > 0
    for rid in big[0]:
        np.testing.assert_array_equal(small[0][rid], big[0][rid])
    assert small[2] == big[2]
    assert eng.blocks.used == 0


def test_pool_must_hold_one_full_request(model):
    with pytest.raises(ValueError, match="kv_cache_tokens=100 cannot hold one request of max_seq_len=512"):
        _engine(model, kv_cache_tokens=100)


def test_pool_sized_in_gib(model, tiny_ckpt):
    """kv_cache_memory_gb: the pool holds the whole blocks that fit, by the checkpoint's layers, heads and dtype;
    too little for one request says what to set; the settings refuse it beside kv_cache_tokens."""
    import json

    from s2tts import settings
    from s2tts.errors import S2Error

    cfg = json.loads((tiny_ckpt / "config.json").read_text())["text_config"]  # the slow AR's
    per = 2 * cfg["n_layer"] * cfg["n_local_heads"] * cfg["head_dim"] * 4  # keys and values, fp32
    gib = 3000 * per / (1 << 30)  # 3000 tokens' worth, fp32
    eng = _engine(model, kv_block_tokens=16, max_seq_len=512, kv_cache_memory_gb=gib)
    assert eng.kv_capacity_tokens == 3000 // 16 * 16 and eng.runner.block_bytes == 16 * per
    with pytest.raises(ValueError, match=r"kv_cache_memory_gb=.* holds 496 tokens .* raise kv_cache_memory_gb to at "
                                         r"least"):
        _engine(model, kv_block_tokens=16, max_seq_len=512, kv_cache_memory_gb=500 * per / (1 << 30))
    with pytest.raises(S2Error, match="both size the KV cache"):
        settings.resolve({"checkpoint": str(tiny_ckpt), "kv_cache_tokens": "4096", "kv_cache_memory_gb": "1"})
    assert settings.resolve({"checkpoint": str(tiny_ckpt), "kv_cache_memory_gb": "1"})["kv_cache_tokens"] is None


def test_block_pool_bookkeeping():
    pool = BlockPool(6, 4, slots=3, max_seq=16)
    assert pool.capacity == 5 and pool.max_blocks == 4
    a = pool.alloc(2)
    pool.assign(0, a)
    pool.extend([(0, pool.alloc(1)[0])])
    assert pool.holds(0) == 3 and pool.table[0, :3].tolist() == pool.owned[0] and pool.table[0, 3] == 0
    pool.retain(a[:1])
    pool.free_slot(0)
    assert pool.free == 4 and pool.refs[a[0]] == 1  # the retained block stays out of the free list
    pool.release(a[:1])
    assert pool.free == 5
    with pytest.raises(MemoryError):
        pool.alloc(6)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(a[:1])


def _count_rows(eng):
    """Wrap eng.runner._slow_pass: record (decode rows, prompt rows, request ids with prompt rows) of every pass."""
    passes, inner = [], eng.runner._slow_pass

    def counted(decoding, chunks, first):
        passes.append((len(decoding), sum(e - s for _, s, e in chunks), [r.id for r, _, _ in chunks]))
        return inner(decoding, chunks, first)

    eng.runner._slow_pass = counted
    return passes


def test_long_prompts_prefill_in_chunks_with_the_same_result(model, requests):
    """max_prefill_tokens=16: every prompt (36-130 tokens) is prefilled at most 16 tokens a step, in the same passes
    as the decode rows of the requests already running, with the logits and codes of a prefill in one pass."""
    whole = _engine(model, kv_block_tokens=8, max_prefill_tokens=512)
    whole_passes = _count_rows(whole)
    whole = _run(whole, requests)
    eng = _engine(model, kv_block_tokens=8, max_prefill_tokens=16)
    passes = _count_rows(eng)
    chunked = _run(eng, requests)
    assert min(len(p) for _, p, _ in requests) > 32
    # r3 shares r2's voice prefix if r2 had prefilled it when r3 arrived (16 tokens a step: it had not)
    hit = eng.prefix_cache.hits == 1
    assert eng.prefix_cache.hits + eng.prefix_cache.misses == 2
    todo = [len(p) for _, p, _ in requests[:3]] + [len(requests[3][1]) - hit * requests[3][1].prefix_len]
    assert max(n for _, n, _ in passes) == 16 and sum(n for _, n, _ in passes) == sum(todo)
    assert any(d and n for d, n, _ in passes)  # prompt rows beside decode rows: one pass over the weights
    assert len(passes) == len(whole_passes) + sum(-(-n // 16) - 1 for n in todo)  # no pass of its own per arrival
    _assert_same(chunked, whole)


class _Responder:
    def __init__(self):
        self.sent, self.finals = [], 0

    def send(self, response, final):
        self.sent.append(response)
        self.finals += final

    def is_cancelled(self):
        return False


def test_service_says_when_requests_were_paused(model, requests, s2_log):
    """Through the engine service (what slow_ar runs): a pool too small for four growing requests pauses some,
    every request still gets all its frames, and the log says what to raise."""
    import time

    from s2tts.engine.service import EngineService

    longest = max(len(p) + sp.max_new_tokens for _, p, sp in requests)
    eng = _engine(model, kv_block_tokens=8, max_seq_len=longest + 8, kv_cache_tokens=longest + 80, prefix_cache_mb=0)
    svc = EngineService(eng, lambda codes, reason, stats, audio: (codes, reason), lambda e: ("error", e.code))
    try:
        responders = {}
        for rid, p, sp in requests:
            responders[rid] = _Responder()
            assert svc.submit(rid, responders[rid], p, sp, first_chunk_frames=4, chunk_frames=8) is not None
        deadline = time.monotonic() + 120
        while any(r.finals == 0 for r in responders.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        svc.shutdown()
    assert eng.preemptions > 0
    for rid, _, sp in requests:
        sent = responders[rid].sent
        assert responders[rid].finals == 1 and sent[-1][1] == "length"
        assert sum(len(codes) for codes, _ in sent) == sp.max_new_tokens
    assert "the KV cache ran out of blocks" in s2_log.text and "if this repeats, raise kv_cache_tokens" in s2_log.text


def test_admissions_grouped_every_n_steps_while_busy(model, requests):
    """admit_every_steps=3: while requests decode, arrivals join only every third step (prefilled together); an idle
    engine admits at once; every request still gets the codes it gets when admitted at once."""
    plain = _run(_engine(model, kv_block_tokens=8), requests)
    eng = _engine(model, kv_block_tokens=8, admit_every_steps=3)
    passes = _count_rows(eng)
    joined, step = {}, [0]

    def note(e):
        step[0] += 1
        for r in e.live.values():
            joined.setdefault(r.id, step[0])

    grouped = _run(eng, requests, on_step=note)
    assert joined["r0"] == 1  # idle engine: at once
    assert all(joined[rid] % 3 == 1 for rid in ("r1", "r2", "r3"))  # then only every third step
    assert [ids for _, _, ids in passes if ids] == [["r0"], ["r1", "r2", "r3"]]  # one a step, prefilled together
    for rid in plain[0]:
        np.testing.assert_array_equal(grouped[0][rid], plain[0][rid])


def test_pool_sized_by_a_share_of_the_gpu(model, tiny_ckpt):
    """gpu_memory_utilization: the KV pool gets what the share leaves after what the process holds (weights, codec)
    and the room kept for CUDA graphs; too small a share names the least one that holds a request; the settings
    refuse it beside either other size, and leave kv_cache_tokens unset with it."""
    from s2tts import settings
    from s2tts.engine.runner import ModelRunner
    from s2tts.engine.build import kv_gib_for_utilization
    from s2tts.sizing import ENGINE_RESERVE_GIB
    from s2tts.errors import S2Error

    cfg, G = model.s2.text, 1 << 30
    per = ModelRunner.kv_token_bytes(cfg, torch.bfloat16)
    gib = kv_gib_for_utilization(0.5, 80 * G, 12 * G, cfg, torch.bfloat16, 4096)
    assert gib == pytest.approx(40 - 12 - ENGINE_RESERVE_GIB)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 gives this engine 8.0 GiB of its GPU's 80.0 GiB, "
                                         r"and it already holds 12.0 GiB .* raise gpu_memory_utilization to at least "
                                         r"0.17 or lower max_seq_len"):
        kv_gib_for_utilization(0.1, 80 * G, 12 * G, cfg, torch.bfloat16, 4096)
    # the least share it names is enough: one request of max_seq_len fits
    least = (12 * G + 4096 * per) / (80 * G) + ENGINE_RESERVE_GIB / 80
    assert kv_gib_for_utilization(least + 1e-6, 80 * G, 12 * G, cfg, torch.bfloat16, 4096) * G >= 4096 * per
    base = {"checkpoint": str(tiny_ckpt)}
    for other in ({"kv_cache_tokens": "4096"}, {"kv_cache_memory_gb": "1"}):
        with pytest.raises(S2Error, match="both size the KV cache: set one of them"):
            settings.resolve({**base, **other, "gpu_memory_utilization": "0.5"})
    with pytest.raises(S2Error, match="gpu_memory_utilization=1.5 is above its maximum 1"):
        settings.resolve({**base, "gpu_memory_utilization": "1.5"})
    v = settings.resolve({**base, "gpu_memory_utilization": "0.5"})
    assert v["kv_cache_tokens"] is None and v["gpu_memory_utilization"] == 0.5


def test_a_share_of_the_gpu_on_a_cpu_takes_the_default_pool(harness_factory):
    """On a CPU (the same repository, device=cpu) gpu_memory_utilization leaves the KV pool at its default size, and
    slow_ar's log says so."""
    import logging

    from s2tts.settings import default_kv_tokens

    lines = []
    keep = logging.Handler()
    keep.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("s2tts")  # (the models' own handler does not propagate)
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        h = harness_factory(gpu_memory_utilization="0.5", max_batch="3", max_seq_len="1024")
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    engine = h.models["slow_ar"].service.engine
    tokens = default_kv_tokens({"max_batch": 3, "max_seq_len": 1024})
    assert engine.kv_capacity_tokens == -(-tokens // engine.blocks.block_size) * engine.blocks.block_size
    assert f"slow_ar: gpu_memory_utilization applies to a GPU; on cpu the KV cache takes its default, {tokens} " \
           "tokens" in lines
