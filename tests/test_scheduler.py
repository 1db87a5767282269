"""The engine's scheduler by itself: no model, no device. Plans are run by a stand-in for the model runner that
returns frames made from the plan (code 0 = the request's frame count), so every assertion is about what the
scheduler decided: rows, admissions, blocks, preemption, the prefix cache, ends."""

import numpy as np
import pytest
import torch

from s2tts.engine import FINISH_CANCELLED, FINISH_END, FINISH_LENGTH, EngineConfig, Scheduler, StepResult
from s2tts.engine.prompt import Prompt
from s2tts.ar.sampling import SamplingParams

C = 3  # codebooks
SEM = 100  # semantic_start_id


def prompt(n: int, prefix: int = 0, voice: int = 0) -> Prompt:
    """n tokens; the first `prefix` are a voice prefix that depends on `voice` only."""
    tokens = torch.arange(n, dtype=torch.int64) + 1000
    tokens[:prefix] = voice * 7 + torch.arange(prefix)
    return Prompt(tokens, torch.zeros(n, C, dtype=torch.int64), torch.zeros(n, dtype=torch.bool), prefix_len=prefix)


def sched(num_blocks=33, block_size=4, block_bytes=1, **config) -> Scheduler:
    """A scheduler of 4 slots of 64 tokens, a pool of 33 blocks of 4 tokens, 16 prompt tokens a step, no prefix
    cache (`config`: `EngineConfig` fields to change)."""
    config = EngineConfig(**{"max_batch": 4, "max_seq_len": 64, "max_prefill_tokens": 16, "prefix_cache_mb": 0, **config})
    return Scheduler(config, num_codebooks=C, semantic_start_id=SEM, num_blocks=num_blocks, block_size=block_size,
                     block_bytes=block_bytes)


def add(s: Scheduler, rid: str, n: int, frames: int = 50, **kw):
    r = s.make_request(rid, prompt(n, **kw), SamplingParams(seed=1, max_new_tokens=frames))
    s.add(r)
    return r


def run(s: Scheduler, plan, ended=()):
    """Execute a plan as a runner would: one frame per sampled request (code 0 = frames it had), or its end."""
    sampled = plan.sampled
    frames = np.array([[r.generated] + [0] * (C - 1) for r in sampled], dtype=np.int32).reshape(-1, C)
    return s.update(plan, StepResult(frames, np.array([r.id in ended for r in sampled], dtype=bool)))


def test_prefill_is_chunked_oldest_first_within_the_budget():
    s = sched()
    add(s, "a", 20)
    add(s, "b", 10)
    plan = s.schedule()
    assert [(c.request.id, c.start, c.end) for c in plan.prefill] == [("a", 0, 16)] and not plan.decode
    assert [r.id for r in plan.starts] == ["a"] and plan.sampled == []
    assert run(s, plan) == []
    plan = s.schedule()  # a's last 4 tokens, then 10 of b's in the 12 left, and a's first frame
    assert [(c.request.id, c.start, c.end) for c in plan.prefill] == [("a", 16, 20), ("b", 0, 10)]
    assert [r.id for r in plan.starts] == ["b"] and [r.id for r in plan.sampled] == ["a", "b"]
    out = run(s, plan)
    assert [(o.request_id, o.codes.shape, o.finished) for o in out] == [("a", (1, C), False), ("b", (1, C), False)]
    assert all(o.queue_s is not None for o in out)  # a first output says how long it waited for a slot
    plan = s.schedule()
    assert [r.id for r in plan.decode] == ["a", "b"] and not plan.prefill
    run(s, plan)
    assert [r.length for r in plan.decode] == [21, 11]  # prompt + one decode row each


def test_a_chunk_longer_than_the_budget_left_waits_for_the_next_step():
    s = sched(max_prefill_tokens=16)
    add(s, "a", 10)
    add(s, "b", 10)
    plan = s.schedule()
    assert [(c.request.id, c.start, c.end) for c in plan.prefill] == [("a", 0, 10), ("b", 0, 6)]


def test_slots_and_queue_order():
    s = sched(max_batch=2)
    for rid in "abc":
        add(s, rid, 4)
    plan = s.schedule()
    assert [c.request.id for c in plan.prefill] == ["a", "b"] and s.where("c") == "waiting"
    run(s, plan, ended={"a"})  # a ends at its first frame: its slot is free for c
    assert s.where("a") == "unknown" and s.counts()["free_slots"] == 1
    plan = s.schedule()
    assert [r.id for r in plan.decode] == ["b"] and [c.request.id for c in plan.prefill] == ["c"]


def test_ends_by_end_token_and_by_length_free_slot_and_blocks():
    s = sched()
    add(s, "short", 4, frames=2)
    add(s, "ender", 4)
    outs = run(s, s.schedule()) + run(s, s.schedule(), ended={"ender"})
    final = {o.request_id: o for o in outs if o.finished}
    assert final["short"].finish_reason == FINISH_LENGTH and final["short"].codes.shape == (1, C)
    assert final["ender"].finish_reason == FINISH_END and final["ender"].codes.shape == (0, C)
    assert not s.has_work() and s.pool.used == 0 and s.counts()["free_slots"] == 4


def test_abort_ends_waiting_and_live_requests_and_ignores_unknown_ids():
    s = sched(max_batch=1)
    add(s, "live", 4)
    add(s, "queued", 4)
    run(s, s.schedule())
    out = s.abort({"queued", "live", "never-seen"})
    assert sorted((o.request_id, o.finish_reason) for o in out) == [("live", FINISH_CANCELLED), ("queued", FINISH_CANCELLED)]
    assert not s.has_work() and s.pool.used == 0


def test_blocks_grow_at_block_boundaries_and_the_table_follows():
    s = sched(block_size=4)
    r = add(s, "a", 5)  # 2 blocks for its prompt
    plan = s.schedule()
    copies, rows = s.pool.take_changes()
    assert copies == [] and rows == [r.slot] and s.pool.holds(r.slot) == 2
    assert s.pool.table[r.slot, :2].tolist() == s.pool.owned[r.slot] and s.pool.table[r.slot, 2] == 0
    run(s, plan)  # length 5
    for length in (6, 7, 8):
        run(s, s.schedule())
        assert r.length == length and s.pool.holds(r.slot) == 2
    s.schedule()  # writes position 8: a third block
    assert s.pool.holds(r.slot) == 3 and s.pool.take_changes()[1] == [r.slot]
    s.abort({"a"})
    assert s.pool.take_changes()[1] == [r.slot] and not s.pool.table.any()


def test_preemption_frees_the_last_admitted_which_resumes_with_its_frames():
    # 4 usable blocks of 4 tokens: two 7-token prompts take 2 each; the first to need a third preempts the other
    s = sched(num_blocks=5, block_size=4, max_batch=2, max_seq_len=16)  # a pool of one whole sequence
    a, b = add(s, "a", 7), add(s, "b", 7)
    run(s, s.schedule())  # both prefilled, first frames (length 7)
    run(s, s.schedule())  # length 8: both fill their second block
    plan = s.schedule()  # each needs a third: b (admitted last) is preempted
    assert s.preemptions == 1 and [r.id for r in plan.decode] == ["a"] and s.where("b") == "waiting"
    assert b.slot == -1 and b.length == 0 and len(b.frames) == 2
    run(s, plan)
    while s.where("a") == "live":
        run(s, s.schedule())
    assert a.generated == 8  # all its sequence allows (16 - 7 - 1)
    plan = s.schedule()  # b back, its prompt and its 2 frames prefilled again, then it goes on from frame 3
    (chunk,) = plan.prefill
    assert chunk.request is b and (chunk.start, chunk.end) == (0, 9) and chunk.last
    assert b.source.tokens[7:].tolist() == [SEM + 0, SEM + 1]  # its frames' code 0 as semantic tokens
    out = run(s, plan)
    assert out[0].codes[0, 0] == 2 and b.generated == 3


def test_admit_every_batches_arrivals_while_others_decode():
    s = sched(admit_every_steps=3)
    add(s, "first", 4)
    plan = s.schedule()
    assert [c.request.id for c in plan.prefill] == ["first"]  # an idle engine admits at once
    run(s, plan)
    add(s, "late", 4)
    admitted = []
    for _ in range(3):
        plan = s.schedule()
        admitted.append([c.request.id for c in plan.prefill])
        run(s, plan)
    assert admitted == [[], [], ["late"]]


def test_a_voice_prefix_enters_the_cache_and_the_next_request_of_the_voice_shares_its_blocks():
    s = sched(block_size=4, prefix_cache_mb=1, block_bytes=(1 << 20) // 100, max_prefill_tokens=64)  # 100 blocks
    s.prefix_cache.min_tokens = 8
    a = add(s, "a", 14, prefix=10)
    run(s, s.schedule())  # a's prompt in one chunk: its prefix (2 full blocks + 2 tokens) enters the cache
    full = s.pool.owned[a.slot][:2]
    copies, _ = s.pool.take_changes()
    (entry,) = s.prefix_cache.entries.values()
    assert entry.length == 10 and entry.blocks[:2] == full and copies == [(s.pool.owned[a.slot][2], entry.blocks[2])]
    b = add(s, "b", 12, prefix=10)
    plan = s.schedule()
    assert b.start == 10 and [(c.start, c.end) for c in plan.prefill] == [(10, 12)]
    assert s.pool.owned[b.slot][:2] == full and all(s.pool.refs[x] == 3 for x in full)  # a, the cache, b
    copies, _ = s.pool.take_changes()
    assert copies == [(entry.blocks[2], s.pool.owned[b.slot][2])]  # its own copy of the partial block
    other = add(s, "other-voice", 12, prefix=10, voice=1)
    s.schedule()
    assert other.start == 0 and s.prefix_cache.hits == 1


def test_a_request_that_cannot_fit_is_refused_with_what_to_change():
    s = sched(max_seq_len=64)
    with pytest.raises(ValueError, match="prompt is 63 tokens, over this server's limit of 62: shorten"):
        s.make_request("x", prompt(63), SamplingParams())
    r = s.make_request("y", prompt(60), SamplingParams(max_new_tokens=100))
    assert r.max_new == 3  # what the sequence has room for
