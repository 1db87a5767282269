"""Write an S2-shaped checkpoint directory with random weights.

The directory has exactly the official layout, file names, tensor names and config
fields of `fishaudio/s2-pro`. `size="tiny"` gives small dims (written in seconds on a
CPU, used by the tests); `size="full"` gives the real S2 Pro shapes (~9.1 GB of bf16)
for speed work on a GPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .ar.loading import INDEX_FILE, expected_tensors
from .checkpoint_config import (
    IM_END,
    IM_START,
    SEMANTIC_TEMPLATE,
    VOICE,
    S2Config,
    _special_token_ids,
)
from .codec.loading import CODEC_FILE, codec_state_dict
from .codec.model import full_codec_config, make_codec, tiny_codec_config

# Special tokens in the order of the Qwen3 / S2 vocabulary (after the BPE vocabulary).
_HEAD_SPECIALS = ["<|endoftext|>", IM_START, IM_END]
_N_RESERVED = 23  # Qwen's other special tokens between <|im_end|> and <|pad|>
_S2_SPECIALS = ["<|pad|>", "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>", VOICE, "<|interleave|>",
                "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]

_CORPUS = """The quick brown fox jumps over the lazy dog. Hello world, this is a test of speech synthesis.
Convert the provided text to speech. A voice reference is a short clip and its transcript.
Streaming audio arrives in chunks; each chunk is decoded as soon as its frames exist.
system user assistant speaker reference text speech the of and to in is that it for on with as was
"""

CODEBOOKS = 10  # codebooks a frame, as S2 Pro's: the semantic one and 9 residual ones (every size)
SIZES = {
    "tiny": dict(
        base_vocab=None, semantic=64, residual=32,
        text=dict(n_layer=2, n_head=4, n_local_heads=2, head_dim=16, dim=64, intermediate_size=128, max_seq_len=4096),
        audio=dict(n_layer=2, n_head=4, n_local_heads=2, head_dim=16, dim=64, intermediate_size=128),
    ),
    "full": dict(
        base_vocab=151643, semantic=4096, residual=1024,
        text=dict(n_layer=36, n_head=32, n_local_heads=8, head_dim=128, dim=2560, intermediate_size=9728, max_seq_len=32768),
        audio=dict(n_layer=4, n_head=32, n_local_heads=8, head_dim=128, dim=2560, intermediate_size=9728),
    ),
}


def make_tokenizer(base_vocab: int | None, num_semantic: int) -> str:
    """A byte-level BPE tokenizer.json with the S2 special tokens, as a JSON string."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    if base_vocab is not None:  # pad the BPE vocabulary so special ids land where the real ones are
        for i in range(len(vocab), base_vocab):
            vocab[f"<unused_{i}>"] = i
    n = len(vocab)
    names = _HEAD_SPECIALS + [f"<|reserved_{i}|>" for i in range(_N_RESERVED)] + _S2_SPECIALS
    names += [SEMANTIC_TEMPLATE.format(i) for i in range(num_semantic)]
    data["added_tokens"] = [
        dict(id=n + i, content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for i, s in enumerate(names)
    ]
    return json.dumps(data, ensure_ascii=False)


def make_config(size: str, special_ids: dict[str, int]) -> dict:
    spec = SIZES[size]
    sem0 = special_ids[SEMANTIC_TEMPLATE.format(0)]
    sem_end = sem0 + spec["semantic"] - 1
    vocab_size = int(math.ceil((sem_end + 1) / 8) * 8) if size == "full" else sem_end + 1
    common = dict(rope_base=1e6, norm_eps=1e-6, attention_qkv_bias=False, attention_o_bias=False)
    text = dict(model_type="fish_qwen3", vocab_size=vocab_size, tie_word_embeddings=True, attention_qk_norm=True,
                **common, **spec["text"])
    audio = dict(model_type="fish_qwen3_audio_decoder", vocab_size=spec["semantic"], num_codebooks=CODEBOOKS,
                 max_seq_len=11, text_dim=spec["text"]["dim"], tie_word_embeddings=False, attention_qk_norm=False,
                 **common, **spec["audio"])
    return dict(
        model_type="fish_qwen3_omni", dtype="bfloat16", sample_rate=44100,
        eos_token_id=special_ids[IM_END], pad_token_id=special_ids["<|pad|>"],
        audio_pad_token_id=special_ids["<|audio_pad|>"],
        semantic_start_token_id=sem0, semantic_end_token_id=sem_end,
        text_config=text, audio_decoder_config=audio,
    )


def _init_tensor(name: str, shape, gen: torch.Generator, device) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    t = torch.empty(shape, dtype=torch.float32, device=device)
    std = 0.02 if len(shape) == 2 else 1.0
    t.normal_(0.0, std, generator=gen)
    return t.to(torch.bfloat16)


def write_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0, device: str = "cpu") -> Path:
    """Write the checkpoint directory `out`; returns its path."""
    from safetensors.torch import save_file


    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = SIZES[size]

    tok_json = make_tokenizer(spec["base_vocab"], spec["semantic"])
    (out / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    special_ids = _special_token_ids(json.loads(tok_json))
    cfg = make_config(size, special_ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": IM_END, "pad_token": "<|pad|>", "model_max_length": cfg["text_config"]["max_seq_len"],
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2), encoding="utf-8")
    (out / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<|voice|>{% endif %}", encoding="utf-8")

    s2 = S2Config.from_dicts(cfg, special_ids)
    shapes = expected_tensors(s2)
    gen = torch.Generator(device=device).manual_seed(seed)
    names = list(shapes)
    half = len(names) // 2
    shards = [names[:half], names[half:]]
    weight_map, total = {}, 0
    for i, group in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: _init_tensor(n, shapes[n], gen, device).cpu() for n in group}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")

    codec_cfg = tiny_codec_config() if size == "tiny" else full_codec_config()
    assert codec_cfg.semantic_codebook_size == spec["semantic"] and codec_cfg.codebook_size == spec["residual"]
    codec = make_codec(codec_cfg, seed)
    torch.save(codec_state_dict(codec), out / CODEC_FILE)
    return out
