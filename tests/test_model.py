"""The model package on the tiny checkpoint: loading, KV cache, batching, seeds, prompts."""

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from s2tts.ar.loading import INDEX_FILE, load_model
from s2tts.checkpoint_config import CheckpointError, S2Config
from s2tts.engine import Engine, EngineConfig
from s2tts.ar.sampling import SamplingParams, sample, uniform

RESIDUAL = 32  # the tiny codec's residual codebook size


def _copy(tiny_ckpt, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, d)
    return d


def _edit_shard(d, fn):
    """Apply fn(tensors: dict) to the first shard and fix the index accordingly."""
    index = json.loads((d / INDEX_FILE).read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(str(d / shard))
    fn(tensors)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard or k in tensors}
    index["weight_map"].update({k: shard for k in tensors})
    (d / INDEX_FILE).write_text(json.dumps(index))


def test_config_reads_ids_from_checkpoint(tiny_ckpt):
    s2 = S2Config.from_dir(tiny_ckpt)
    tok = json.loads((tiny_ckpt / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert s2.im_end_id == ids["<|im_end|>"] and s2.voice_id == ids["<|voice|>"]
    assert s2.semantic_start_id == ids["<|semantic:0|>"]
    assert s2.num_semantic == s2.codebook_size == 64 and s2.num_codebooks == 10
    assert s2.sample_rate == 44100


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path)
    victim = "text_model.model.layers.1.attention.k_norm.weight"

    def drop(t):
        t.pop(victim, None)

    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"].pop(victim)
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load_model(d, "cpu", "fp32")


def test_misshaped_tensor_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path)
    index = json.loads((d / INDEX_FILE).read_text())
    name = sorted(k for k, v in index["weight_map"].items() if v == sorted(set(index["weight_map"].values()))[0])[0]

    def shrink(t):
        t[name] = t[name][..., :1].contiguous()

    _edit_shard(d, shrink)
    with pytest.raises(CheckpointError, match=rf"{name.replace('.', chr(92) + '.')} has shape"):
        load_model(d, "cpu", "fp32")


def test_extra_tensor_loads_and_is_named(tiny_ckpt, tmp_path, s2_log):
    d = _copy(tiny_ckpt, tmp_path)

    def add(t):
        t["text_model.model.freqs_cis"] = torch.zeros(8, 4, 2)
        t["discriminator.conv.weight"] = torch.zeros(3)

    _edit_shard(d, add)
    m = load_model(d, "cpu", "fp32")
    assert m.slow.head.shape[0] == m.s2.num_semantic + 1
    lines = [r.getMessage() for r in s2_log.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and "text_model.model.freqs_cis" in lines[0] and "discriminator.conv.weight" in lines[0]


def test_loaded_weights_match_file(tiny_ckpt, model):
    index = json.loads((tiny_ckpt / INDEX_FILE).read_text())
    shard = index["weight_map"]["audio_decoder.output.weight"]
    t = load_file(str(tiny_ckpt / shard))["audio_decoder.output.weight"]
    assert torch.equal(model.fast.output.weight, t.float())
    assert model.slow.head.shape == (65, model.s2.text.dim)


def test_loading_builds_on_meta_without_initializers_or_dynamo(tiny_ckpt):
    """The loaders build their modules on the meta device with torch.nn.init's functions skipped and restored after
    (`s2tts.gpu.meta.on_meta`): in a fresh interpreter, loading both ARs and the codec imports no torch._dynamo (which
    PyTorch's meta initializers and meta arange would import: ~2 s of CPU in every model process), and the rope
    tables are the real ones."""
    code = f"""
import sys, torch
init = {{n: getattr(torch.nn.init, n) for n in ("normal_", "uniform_", "kaiming_uniform_", "zeros_")}}
from s2tts.ar.loading import load_model
from s2tts.codec.loading import load_codec_from_dir
from s2tts.ar.model import rope_table
m = load_model({str(tiny_ckpt)!r}, "cpu", "fp32")
load_codec_from_dir({str(tiny_ckpt)!r}, "cpu", "fp32")
assert all(getattr(torch.nn.init, n) is f for n, f in init.items())
s = m.slow.stack
assert torch.equal(s.rope, rope_table(s.rope.shape[0], s.cfg.head_dim, s.cfg.rope_base))
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "dynamo imported: False", out.stdout


def test_kv_cache_decode_matches_full_forward(model, prompts):
    s2 = model.s2
    p = prompts.build("Check the cache, please.")
    T, extra = len(p), 6
    gen = torch.Generator().manual_seed(0)
    new_codes = torch.randint(0, s2.codebook_size // 2, (extra, s2.num_codebooks), generator=gen)
    tokens = torch.cat([p.tokens, new_codes[:, 0] + s2.semantic_start_id])
    codes = torch.cat([p.codes, new_codes])
    sem = torch.cat([p.semantic, torch.ones(extra, dtype=torch.bool)])
    x = model.embed(tokens[None], codes[None], sem[None])
    pos = torch.arange(T + extra)[None]
    with torch.inference_mode():
        _, full = model.slow(x, pos)  # no cache: plain causal attention
        model.slow.stack.setup_caches(2, 64, torch.float32, "cpu")
        slots = torch.tensor([1])
        _, pre = model.slow(x[:, :T], pos[:, :T], slots, kv_len_max=T)
        steps = [pre[:, -1]]
        for i in range(T, T + extra):
            _, lg = model.slow(x[:, i : i + 1], pos[:, i : i + 1], slots, kv_len_max=i + 1)
            steps.append(lg[:, -1])
    torch.testing.assert_close(pre[0], full[0, :T], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.stack(steps[1:], 1)[0], full[0, T:], rtol=1e-4, atol=1e-4)
    assert not torch.equal(full[0, -1], full[0, -2])  # the logits do depend on the position


def _run(model, reqs, params_for, record):
    """Run requests together in one engine; returns {id: codes [C, n]} and records logits per id."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256))
    eng.logits_hook = lambda ids, lg: [record.setdefault(i, []).append(lg[j].clone()) for j, i in enumerate(ids)]
    for rid, prompt in reqs:
        eng.submit(rid, prompt, params_for(rid))
    frames = {rid: [] for rid, _ in reqs}
    done = set()
    while len(done) < len(reqs):
        for o in eng.step():
            frames[o.request_id].append(o.codes)
            if o.finished:
                done.add(o.request_id)
    return {k: np.concatenate(v).T for k, v in frames.items()}


def test_batch_matches_alone(model, prompts):
    texts = {"a": "Short one.", "b": "A somewhat longer sentence to speak here.", "c": "Middle length text."}
    reqs = [(k, prompts.build(t)) for k, t in texts.items()]
    assert len({len(p) for _, p in reqs}) == 3  # different prompt lengths
    params = lambda rid: SamplingParams(seed=100 + ord(rid), max_new_tokens=12)  # noqa: E731
    together_logits = {}
    together = _run(model, reqs, params, together_logits)
    for rid, prompt in reqs:
        alone_logits = {}
        alone = _run(model, [(rid, prompt)], params, alone_logits)
        np.testing.assert_array_equal(together[rid], alone[rid])
        assert len(together_logits[rid]) == len(alone_logits[rid])
        for a, b in zip(together_logits[rid], alone_logits[rid]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not np.array_equal(together["a"][:, :3], together["b"][:, :3])


def test_seed_reproducible_and_seeds_differ(model, prompts):
    p = prompts.build("Seeds make it reproducible.")
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=256))
    a, _ = eng.generate(p, SamplingParams(seed=7, max_new_tokens=20))
    b, _ = eng.generate(p, SamplingParams(seed=7, max_new_tokens=20), request_id="again")
    c, _ = eng.generate(p, SamplingParams(seed=8, max_new_tokens=20), request_id="other")
    np.testing.assert_array_equal(a, b)
    assert a.shape[0] == 10 and a.shape[1] >= 1
    assert a[0].max() < 64 and a[1:].max() < RESIDUAL and a.min() >= 0
    assert not np.array_equal(a[:, : min(a.shape[1], c.shape[1])], c[:, : min(a.shape[1], c.shape[1])])


def test_each_slot_holds_its_requests_sampling_settings(model, prompts):
    """Requests that start in one step with different settings: each one's slot holds its own temperature, top-p,
    top-k, seed and end rule (the runner uploads them together and scatters them by slot)."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256))
    params = {"a": SamplingParams(seed=11, temperature=0.0, top_p=0.5, top_k=7, max_new_tokens=3),
              "b": SamplingParams(seed=2**40 + 5, temperature=1.3, top_p=0.9, top_k=0, max_new_tokens=3,
                                  ignore_end=True),
              "c": SamplingParams(seed=3, temperature=0.6, top_p=1.0, top_k=100, max_new_tokens=3)}
    for rid, p in params.items():
        eng.submit(rid, prompts.build(f"Request {rid}."), p)
    eng.step()
    live = {r.id: r for r in eng.scheduler.live.values()}
    assert set(live) == set(params) and len({r.slot for r in live.values()}) == 3
    run = eng.runner
    for rid, p in params.items():
        r = live[rid]
        got = (float(run.temperature[r.slot]), float(run.top_p[r.slot]), int(run.top_k[r.slot]),
               int(run.seed[r.slot]), bool(run.allow_end[r.slot]))
        assert got == pytest.approx((p.temperature, p.top_p, p.top_k, r.seed, not p.ignore_end)), (rid, got)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_host_to_device_copies_keep_values(device):
    """`gpu.transfer.upload` / `copy_in` (page-locked and queued on a GPU): the same values and dtype on the device."""
    from s2tts.gpu.transfer import copy_in, upload

    src = torch.tensor([[3, -1, 2**40], [7, 0, 5]], dtype=torch.int64)
    up = upload(src, device)
    assert up.device.type == device and up.dtype == torch.int64 and torch.equal(up.cpu(), src)
    dst = torch.zeros(2, 3, dtype=torch.int64, device=device)
    assert copy_in(dst, src) is dst and torch.equal(dst.cpu(), src)


def test_length_limit_and_end_token(model, prompts):
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=256))
    codes, reason = eng.generate(prompts.build("Stop at five."), SamplingParams(seed=3, max_new_tokens=5))
    assert (codes.shape[1], reason) == (5, "length") or (codes.shape[1] < 5 and reason == "end")
    # 40 seeds sampled over the whole vocabulary, submitted together: some meet the end token within 30 frames,
    # some do not (each request's draws depend on its seed only, whatever runs beside it)
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=40, max_seq_len=256))
    for seed in range(40):
        eng.submit(f"s{seed}", prompts.build("Any."),
                   SamplingParams(seed=seed, max_new_tokens=30, temperature=1.0, top_p=1.0, top_k=4096))
    reasons = set()
    while eng.has_work():
        reasons |= {o.finish_reason for o in eng.step() if o.finished}
    assert reasons == {"end", "length"}


def test_cancel_leaves_others_running(model, prompts):
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=4, max_seq_len=256))
    eng.submit("x", prompts.build("Cancel me."), SamplingParams(seed=1, max_new_tokens=50, temperature=0))
    eng.submit("y", prompts.build("Keep me."), SamplingParams(seed=2, max_new_tokens=8))
    eng.step()
    eng.cancel("x")
    outs = eng.step()
    assert any(o.request_id == "x" and o.finished and o.finish_reason == "cancelled" for o in outs)
    finished = set()
    while eng.has_work():
        finished |= {o.request_id for o in eng.step() if o.finished}
    assert "y" in finished and not eng.live


def test_sampling_respects_top_k_and_is_counter_based():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    seed = torch.tensor([1, 2, 3])
    step = torch.tensor([0, 0, 5])
    t, p = torch.full((3,), 1.0), torch.ones(3)
    k = torch.tensor([1, 5, 100])
    draws = torch.stack([sample(logits, t, p, k, seed, step + i, 0) for i in range(200)])
    assert (draws[:, 0] == logits[0].argmax()).all()  # top_k 1 = greedy
    top5 = set(logits[1].topk(5).indices.tolist())
    assert set(draws[:, 1].tolist()) <= top5 and len(set(draws[:, 1].tolist())) > 1
    assert len(set(draws[:, 2].tolist())) > 20  # top_k = vocabulary: no top-k
    # top_k 0 is greedy, as upstream (only rank 0 survives), at any temperature
    zero = torch.stack([sample(logits, torch.full((3,), 1.5), p, torch.zeros(3, dtype=torch.long), seed, step + i, 0)
                        for i in range(50)])
    assert (zero == logits.argmax(-1)).all()
    # row order does not matter: the same (seed, step) gives the same numbers
    u1 = uniform(seed, step, 0, 8)
    u2 = uniform(seed.flip(0), step.flip(0), 0, 8).flip(0)
    assert torch.equal(u1, u2) and 0 < u1.min() and u1.max() < 1


def test_prompt_format(prompts):
    s2 = prompts.s2
    plain = prompts.build("Hello there.")
    assert plain.tokens[0] == s2.im_start_id and plain.tokens[-1] == s2.voice_id
    assert not plain.semantic.any()
    text = prompts.tok.decode(plain.tokens.tolist(), skip_special_tokens=False)
    assert text == ("<|im_start|>system\nconvert the provided text to speech<|im_end|>\n"
                    "<|im_start|>user\nHello there.<|im_end|>\n<|im_start|>assistant\n<|voice|>")
    ref = torch.randint(0, 32, (10, 7))
    clone = prompts.build("Say this.", ref, "What the clip says.")
    assert int(clone.semantic.sum()) == 7
    sem_tokens = clone.tokens[clone.semantic]
    assert torch.equal(sem_tokens - s2.semantic_start_id, ref[0])
    assert torch.equal(clone.codes[clone.semantic], ref.T)
    decoded = prompts.tok.decode(clone.tokens[~clone.semantic].tolist(), skip_special_tokens=False)
    assert "Text:\n<|speaker:0|>What the clip says.\n\nSpeech:\n<|im_end|>" in decoded
    # a transcript with a speaker tag anywhere is left as it is (upstream's re.search): no <|speaker:0|> before it
    tagged = prompts.build("Say this.", ref, "Intro words <|speaker:1|>rest of it.")
    decoded = prompts.tok.decode(tagged.tokens[~tagged.semantic].tolist(), skip_special_tokens=False)
    assert "Text:\nIntro words <|speaker:1|>rest of it.\n\nSpeech:\n" in decoded and "<|speaker:0|>" not in decoded


def test_ras_window_starts_empty_at_the_first_decode_step(model, prompts):
    """As upstream: the code sampled at prefill never enters the RAS window; each decode step adds its own."""
    eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=256))
    eng.submit("a", prompts.build("Window check."), SamplingParams(seed=3, max_new_tokens=8, ignore_end=True))
    first = eng.step()  # prefill + the first frame
    slot = next(iter(eng.live))
    assert first[0].codes.shape[0] == 1 and (eng.runner.recent[slot] == -1).all()
    codes = [first[0].codes[0, 0]]
    for _ in range(3):
        codes.append(eng.step()[0].codes[0, 0])
    assert eng.runner.recent[slot].tolist()[-3:] == [int(c) for c in codes[1:]] and (eng.runner.recent[slot][:-3] == -1).all()


def test_prompt_with_history_and_trimming(prompts):
    """Long-form segments: the prompt of segment k holds segments < k as user turn + assistant turn with their
    codes (upstream's conversation format); trimming to max_tokens drops the oldest turns, never the system turn
    with the voice or the current text."""
    s2 = prompts.s2
    ref = torch.randint(0, 32, (10, 7))
    history = [(f"Segment {k} of the text.", torch.randint(0, 32, (5 + k, 10))) for k in range(3)]
    p = prompts.build("The current segment.", ref, "The clip.", history=history)
    alone = prompts.build("The current segment.", ref, "The clip.")
    assert p.prefix_len == alone.prefix_len and torch.equal(p.tokens[: p.prefix_len], alone.tokens[: alone.prefix_len])
    assert int(p.semantic.sum()) == 7 + 5 + 6 + 7 and p.history_dropped == 0
    runs = torch.cat([ref.T] + [c for _, c in history])
    assert torch.equal(p.codes[p.semantic], runs)  # the voice, then each segment's codes, in order
    assert torch.equal(p.tokens[p.semantic] - s2.semantic_start_id, runs[:, 0])
    text = prompts.tok.decode(p.tokens[p.prefix_len:][~p.semantic[p.prefix_len:]].tolist(), skip_special_tokens=False)
    assert text == "".join(f"<|im_start|>user\nSegment {k} of the text.<|im_end|>\n<|im_start|>assistant\n<|voice|>"
                           "<|im_end|>\n" for k in range(3)) + \
        "<|im_start|>user\nThe current segment.<|im_end|>\n<|im_start|>assistant\n<|voice|>"

    # trimming: room for the newest history turn only
    one = prompts.build("The current segment.", ref, "The clip.", history=history[2:])
    t = prompts.build("The current segment.", ref, "The clip.", history=history, max_tokens=len(one))
    assert t.history_dropped == 2 and torch.equal(t.tokens, one.tokens) and torch.equal(t.codes, one.codes)
    assert prompts.build("The current segment.", ref, "The clip.", history=history,
                         max_tokens=len(alone)).history_dropped == 3
    with pytest.raises(ValueError, match="fit: shorten the reference or the text segment"):
        prompts.build("The current segment.", ref, "The clip.", history=history, max_tokens=len(alone) - 1)
    with pytest.raises(ValueError, match=r"history codes must have shape \[frames, 10\]"):
        prompts.build("Now.", history=[("Before.", torch.zeros(10, 4, dtype=torch.long))])


@pytest.mark.parametrize("text,ref,ref_text,msg", [
    ("", None, None, "empty"),
    ("Hi <|im_end|> there", None, None, "special token"),
    ("Hi", torch.zeros(10, 3, dtype=torch.long), None, "transcript"),
    ("Hi", torch.zeros(9, 3, dtype=torch.long), "x", "shape"),
    ("Hi", None, "a transcript", "without reference"),
])
def test_prompt_rejects_bad_input(prompts, text, ref, ref_text, msg):
    with pytest.raises(ValueError, match=msg):
        prompts.build(text, ref, ref_text)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0).validate()
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1).validate()
    with pytest.raises(ValueError, match=r"max_new_tokens=11 is out of range: use an integer in \[1, 10\]"):
        SamplingParams(max_new_tokens=11).validate(10)


def test_prefix_cache_reuses_voice_prefix(model, prompts):
    """A second request with the same voice reference copies the cached prefix KV and still produces
    the logits and codes of a full prefill."""
    gen = torch.Generator().manual_seed(5)
    ref = torch.randint(0, 32, (10, 40), generator=gen)
    first = prompts.build("First sentence for this voice.", ref, "The reference transcript.")
    second = prompts.build("Another sentence, same voice.", ref, "The reference transcript.")
    assert first.prefix_len == second.prefix_len > 40
    assert torch.equal(first.tokens[: first.prefix_len], second.tokens[: second.prefix_len])
    params = SamplingParams(seed=21, max_new_tokens=10)

    def run(cache_bytes):
        eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=256, prefix_cache_mb=cache_bytes >> 20))
        logits = {}
        eng.logits_hook = lambda ids, lg: [logits.setdefault(i, []).append(lg[j].clone()) for j, i in enumerate(ids)]
        eng.generate(first, params, request_id="a")
        codes, _ = eng.generate(second, params, request_id="b")
        return eng, codes, logits["b"]

    cached, codes_c, logits_c = run(64 << 20)
    plain, codes_p, logits_p = run(0)
    assert (cached.prefix_cache.hits, cached.prefix_cache.misses) == (1, 1) and len(cached.prefix_cache.entries) == 1
    assert plain.prefix_cache.hits == 0
    np.testing.assert_array_equal(codes_c, codes_p)
    for a, b in zip(logits_c, logits_p):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_padded_row_buckets_match_exact_shapes(model, prompts):
    """What the GPU graphs do (pad a pass's rows and a sampling batch to a captured size; padding rows read and write
    only the scratch slot) gives the logits and codes of the exact sizes, with and without a cached voice prefix.
    (The one-pass layout of every token as a row, padded, is checked with the kernels in tests/test_kernels.py.)"""
    gen = torch.Generator().manual_seed(6)
    ref = torch.randint(0, 32, (10, 40), generator=gen)
    reqs = [("p", prompts.build("Plain prompt.")), ("v1", prompts.build("Voice one.", ref, "Ref text.")),
            ("v2", prompts.build("Voice two, longer.", ref, "Ref text."))]
    out = {}
    for padded in (False, True):
        eng = Engine(model, RESIDUAL, EngineConfig(max_batch=3, max_seq_len=1024, prefix_cache_mb=64,
                                                   row_buckets=padded, max_prefill_tokens=40))
        assert eng.runner.pad_rows == padded and eng.runner.sample_sizes == (1, 2, 3) and eng.runner.row_sizes[-1] == 43
        assert eng.runner._bucket(eng.runner.row_sizes, 5) == 8 and eng.runner._bucket(eng.runner.row_sizes, 33) == 43
        logits = {}
        eng.logits_hook = lambda ids, lg: [logits.setdefault(i, []).append(lg[j].clone()) for j, i in enumerate(ids)]
        codes = {}
        for rid, p in reqs:  # one after another: v2 finds v1's prefix in the cache
            codes[rid], _ = eng.generate(p, SamplingParams(seed=3, max_new_tokens=6, ignore_end=True), request_id=rid)
        assert eng.prefix_cache.hits == 1
        out[padded] = (codes, logits)
    for rid, _ in reqs:
        np.testing.assert_array_equal(out[False][0][rid], out[True][0][rid])
        for a, b in zip(out[False][1][rid], out[True][1][rid]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_dependent_launch_only_where_supported(tiny_ckpt):
    """`dependent_launch` (programmatic dependent launch of the decode step's Triton kernels) asks; the device
    decides: a CPU engine asked for it runs without it, and the kernels launch as usual (`kernels.launching_dependent()` off); the mode is a thread's own."""
    from s2tts.ar import kernels

    model = load_model(tiny_ckpt, "cpu", "fp32")
    for asked in (None, True, False):
        eng = Engine(model, RESIDUAL, EngineConfig(max_batch=2, max_seq_len=64, dependent_launch=asked))
        assert eng.runner.dependent_launch is False and kernels.launching_dependent() is False
    assert kernels.pdl_supported(torch.device("cpu")) is False
    seen = []
    with kernels.dependent_launch(True):  # a pass's kernels (the runner checks support first)
        assert kernels.launching_dependent() is True and kernels._pdl() == {"PDL": True, "launch_pdl": True}
        beside = threading.Thread(target=lambda: seen.append((kernels.launching_dependent(), kernels._pdl())))
        beside.start()
        beside.join()
    assert seen == [(False, {"PDL": False})]  # a warm-up in another thread launches in its own mode
    assert kernels.launching_dependent() is False  # the codec's calls and the rest launch as usual


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qk_norm_rounds_once_as_torch_rmsnorm(dtype):
    """The q/k norms (`HeadNorm`) give `torch.nn.RMSNorm`'s bits (upstream's q/k norms: one rounding after the
    weight), traced (the ONNX export's ops) too; the layer norms (`RMSNorm`) keep upstream's own two roundings."""
    from s2tts.ar.model import HeadNorm, RMSNorm

    gen = torch.Generator().manual_seed(4)
    D, eps = 128, 1e-6
    x = (torch.randn(3, 5, 8, D, generator=gen) * torch.rand(3, 5, 8, 1, generator=gen) * 40).to(dtype)
    w = (torch.rand(D, generator=gen) * 2 + 0.1).to(dtype)
    ours, theirs = HeadNorm(D, eps).to(dtype), torch.nn.RMSNorm(D, eps=eps, dtype=dtype)
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
        want = theirs(x)
        assert want.dtype == dtype and torch.equal(ours(x), want)
        assert torch.equal(torch.jit.trace(ours, (x,))(x), want)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        twice = normed.to(dtype) * w
        assert (twice != want).any()  # the inputs tell one rounding from two
        layer = RMSNorm(D, eps).to(dtype)
        layer.weight.copy_(w)
        assert torch.equal(layer(x), twice)


def test_attention_heads_norm_q_and_k_as_torch_rmsnorm(tiny_ckpt):
    """The slow AR's q/k in bf16 (the plain path: prompts, the exported graphs): projected, normed by
    `torch.nn.RMSNorm` with the checkpoint's q/k norm weights, rotated; to the bit."""
    from s2tts.ar.model import Attention, apply_rope, rope_table

    cfg = S2Config.from_dir(tiny_ckpt).text
    assert cfg.qk_norm
    gen = torch.Generator().manual_seed(5)
    att = Attention(cfg)
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.rand(p.shape, generator=gen) * 2 - 0.5)
    att = att.to(torch.bfloat16)
    x = torch.randn(2, 7, cfg.dim, generator=gen).to(torch.bfloat16)
    rope = rope_table(16, cfg.head_dim, cfg.rope_base)[torch.arange(7)].expand(2, 7, -1, -1)
    with torch.no_grad():
        q, k, v = att.heads(x, rope)
        wq, wk, wv = att.wqkv(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        for got, w, norm, heads in ((q, wq, att.q_norm, cfg.n_head), (k, wk, att.k_norm, cfg.n_local_heads)):
            ref = torch.nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps, dtype=torch.bfloat16)
            ref.weight.copy_(norm.weight)
            assert torch.equal(got, apply_rope(ref(w.view(2, 7, heads, cfg.head_dim)), rope))
        assert torch.equal(v, wv.view(2, 7, cfg.n_local_heads, cfg.head_dim))
