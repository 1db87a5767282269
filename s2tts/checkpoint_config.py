"""S2 Pro configuration, read from a checkpoint directory.

Everything the code needs to know about the model (dims, token ids, sample
rate) comes from the checkpoint's `config.json` and `tokenizer.json`; nothing
here is a copied constant except the names of fields and special tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

MODEL_TYPE = "fish_qwen3_omni"

# Special tokens looked up by name in tokenizer.json.
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VOICE = "<|voice|>"
SEMANTIC_TEMPLATE = "<|semantic:{}|>"


class CheckpointError(ValueError):
    """A checkpoint directory that does not match what S2 Pro needs."""


@dataclass(frozen=True)
class ARConfig:
    """One transformer stack (the slow AR's `text_config` or the fast AR's `audio_decoder_config`)."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_local_heads: int
    head_dim: int
    dim: int
    intermediate_size: int
    rope_base: float
    norm_eps: float
    max_seq_len: int
    qk_norm: bool
    tie_word_embeddings: bool

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_local_heads * self.head_dim

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "ARConfig":
        def need(key):
            if key not in d:
                raise CheckpointError(f"config.json: `{where}.{key}` is missing")
            return d[key]

        dim = int(need("dim"))
        n_head = int(need("n_head"))
        return cls(
            vocab_size=int(need("vocab_size")),
            n_layer=int(need("n_layer")),
            n_head=n_head,
            n_local_heads=int(d.get("n_local_heads", n_head)),
            head_dim=int(d.get("head_dim", dim // n_head)),
            dim=dim,
            intermediate_size=int(need("intermediate_size")),
            rope_base=float(d.get("rope_base", 10000.0)),
            norm_eps=float(d.get("norm_eps", 1e-6)),
            max_seq_len=int(need("max_seq_len")),
            qk_norm=bool(d.get("attention_qk_norm", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )


@dataclass(frozen=True)
class S2Config:
    text: ARConfig  # slow AR
    audio: ARConfig  # fast AR
    num_codebooks: int  # 10: code 0 (semantic) + 9 residual
    text_dim: int
    sample_rate: int
    # token ids
    im_start_id: int
    im_end_id: int  # the end-of-speech token (eos_token_id)
    voice_id: int
    pad_token_id: int
    audio_pad_token_id: int
    semantic_start_id: int  # <|semantic:0|>
    semantic_end_id: int  # <|semantic:N-1|>

    @property
    def codebook_size(self) -> int:
        """Entries per codebook row in the fast AR / codebook embeddings (4096)."""
        return self.audio.vocab_size

    @property
    def num_semantic(self) -> int:
        return self.semantic_end_id - self.semantic_start_id + 1

    @property
    def embed_scale(self) -> float:
        """Semantic positions sum the token and all codebook embeddings, scaled by 1/sqrt(n+1)."""
        return 1.0 / math.sqrt(self.num_codebooks + 1)

    @classmethod
    def from_dir(cls, path: str | Path) -> "S2Config":
        path = Path(path)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path} not found: pass the S2 Pro checkpoint directory (the one holding config.json)")
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"{tok_path} not found: the checkpoint directory needs the tokenizer.json of S2 Pro")
        vocab = _special_token_ids(json.loads(tok_path.read_text(encoding="utf-8")))
        return cls.from_dicts(cfg, vocab)

    @classmethod
    def from_dicts(cls, cfg: dict, special_ids: dict[str, int]) -> "S2Config":
        if cfg.get("model_type") != MODEL_TYPE:
            raise CheckpointError(
                f"config.json: model_type is {cfg.get('model_type')!r}, expected {MODEL_TYPE!r} (an S2 Pro checkpoint)"
            )
        for key in ("text_config", "audio_decoder_config"):
            if key not in cfg:
                raise CheckpointError(f"config.json: `{key}` is missing")
        text = ARConfig.from_dict(cfg["text_config"], "text_config")
        audio = ARConfig.from_dict(cfg["audio_decoder_config"], "audio_decoder_config")
        adc = cfg["audio_decoder_config"]

        def need(key):
            if key not in cfg:
                raise CheckpointError(f"config.json: `{key}` is missing")
            return int(cfg[key])

        def token(name):
            if name not in special_ids:
                raise CheckpointError(f"tokenizer.json: special token {name} is missing")
            return special_ids[name]

        sem_start, sem_end = need("semantic_start_token_id"), need("semantic_end_token_id")
        c = cls(
            text=text,
            audio=audio,
            num_codebooks=int(adc.get("num_codebooks", 10)),
            text_dim=int(adc.get("text_dim", text.dim)),
            sample_rate=need("sample_rate"),
            im_start_id=token(IM_START),
            im_end_id=need("eos_token_id"),
            voice_id=token(VOICE),
            pad_token_id=need("pad_token_id"),
            audio_pad_token_id=need("audio_pad_token_id"),
            semantic_start_id=sem_start,
            semantic_end_id=sem_end,
        )
        c.validate(special_ids)
        return c

    def validate(self, special_ids: dict[str, int]) -> None:
        if self.num_semantic != self.codebook_size:
            raise CheckpointError(
                f"config.json: semantic tokens {self.semantic_start_id}..{self.semantic_end_id} "
                f"({self.num_semantic}) do not match audio_decoder_config.vocab_size {self.codebook_size}"
            )
        if self.semantic_end_id >= self.text.vocab_size:
            raise CheckpointError("config.json: semantic_end_token_id is outside text_config.vocab_size")
        if special_ids.get(IM_END, self.im_end_id) != self.im_end_id:
            raise CheckpointError(
                f"config.json eos_token_id {self.im_end_id} != tokenizer.json id of {IM_END} {special_ids[IM_END]}"
            )
        for i in (0, self.num_semantic - 1):
            name = SEMANTIC_TEMPLATE.format(i)
            if name in special_ids and special_ids[name] != self.semantic_start_id + i:
                raise CheckpointError(f"tokenizer.json: {name} has id {special_ids[name]}, config.json implies {self.semantic_start_id + i}")
        if self.text_dim != self.audio.dim:
            raise CheckpointError(
                f"audio_decoder_config: text_dim {self.text_dim} != dim {self.audio.dim} needs a project_in layer, which S2 Pro does not have"
            )


def _special_token_ids(tok: dict) -> dict[str, int]:
    ids = {}
    for t in tok.get("added_tokens", []):
        ids[t["content"]] = int(t["id"])
    return ids
