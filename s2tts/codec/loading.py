"""Loading the codec: codec.pth's state dict (either weight-norm key style, an optional `state_dict` wrapper or
`generator.` prefix) checked against the architecture its shapes imply, folded and assigned; and what a checkpoint
directory's codec.pth says without building the codec (frame length, codebook sizes)."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..checkpoint_config import CheckpointError
from ..gpu.device import parse_dtype, resolve_device
from ..gpu.meta import on_meta
from .model import DAC, CausalConv1d, CausalConvTranspose1d, CodecConfig, VectorQuantize

log = logging.getLogger("s2tts")


def config_from_state_dict(state_dict: dict[str, Tensor], **overrides) -> CodecConfig:
    """The codec's config inferred from tensor shapes (any key style `load_codec` accepts); `overrides` set the fields
    shapes cannot tell."""
    return _infer_config(_normalise(state_dict, fold=False)[0], overrides)


def _weight_norm_keys(model: DAC) -> dict[str, str]:
    """Plain weight key -> how the reference stores it ("parametrizations" or "weight_g")."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (CausalConv1d, CausalConvTranspose1d)) and m.weight_norm:
            out[f"{name}.conv.weight"] = "parametrizations"
        elif isinstance(m, VectorQuantize):
            out[f"{name}.in_proj.weight"] = "weight_g"
            out[f"{name}.out_proj.weight"] = "weight_g"
    return out


def _norm_except_dim0(v: Tensor) -> Tensor:
    return v.norm(dim=tuple(range(1, v.ndim)), keepdim=True)


def codec_state_dict(model: DAC, style: str = "reference") -> dict[str, Tensor]:
    """The model's weights with official key names.

    style "reference": as fish-speech 0.1.0's own `state_dict()` (causal convs as
    `conv.parametrizations.weight.original0/1`, VQ projections as `weight_g/weight_v`);
    "weight_g" or "parametrizations": every weight-normed tensor in that style;
    "plain": folded weights. Persistent RoPE/mask buffers are not written (loaders ignore them).
    """
    if style not in ("reference", "weight_g", "parametrizations", "plain"):
        raise ValueError(f"unknown weight-norm style {style!r}")
    wn = _weight_norm_keys(model)
    out: dict[str, Tensor] = {}
    for key, t in model.state_dict().items():
        t = t.detach().clone()
        kind = wn.get(key) if style == "reference" else (style if key in wn else None)
        if kind in (None, "plain"):
            out[key] = t
            continue
        base = key[: -len(".weight")]
        g = _norm_except_dim0(t.float()).to(t.dtype)
        if kind == "weight_g":
            out[f"{base}.weight_g"], out[f"{base}.weight_v"] = g, t
        else:
            out[f"{base}.parametrizations.weight.original0"] = g
            out[f"{base}.parametrizations.weight.original1"] = t
    return out


_WN_SUFFIXES = {
    ".weight_g": (".weight_v", 0),
    ".weight_v": (".weight_g", 1),
    ".parametrizations.weight.original0": (".parametrizations.weight.original1", 0),
    ".parametrizations.weight.original1": (".parametrizations.weight.original0", 1),
}


def _normalise(raw: dict[str, Any], fold: bool = True) -> tuple[dict[str, Tensor], dict[str, list[str]], list[str]]:
    """Strip the `state_dict` wrapper and `generator.` prefix; turn weight-norm pairs into `.weight`.

    Returns (plain state dict, plain key -> keys as stored (g, v for a pair), unused keys).
    With fold=False a weight-norm pair maps to its direction v (same shape, no arithmetic).
    """
    if isinstance(raw.get("state_dict"), dict):
        raw = raw["state_dict"]
    unused = [k for k, v in raw.items() if not isinstance(v, Tensor)]
    raw = {k: v for k, v in raw.items() if isinstance(v, Tensor)}
    if any(k.startswith("generator.") for k in raw):
        unused += [k for k in raw if not k.startswith("generator.")]
        raw = {k[len("generator.") :]: v for k, v in raw.items() if k.startswith("generator.")}

    sd: dict[str, Tensor] = {}
    source: dict[str, list[str]] = {}
    for key, t in raw.items():
        suffix = next((s for s in _WN_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            sd[key], source[key] = t, [key]
            continue
        partner_suffix, which = _WN_SUFFIXES[suffix]
        base = key[: -len(suffix)]
        partner = base + partner_suffix
        if partner not in raw:
            raise ValueError(f"codec checkpoint: tensor {partner!r} is missing (its weight-norm pair {key!r} is there)")
        if which == 0:
            continue  # g: handled with its v
        g, v = raw[partner], t
        if g.numel() != v.shape[0]:
            raise ValueError(
                f"codec checkpoint: tensor {partner!r} has shape {tuple(g.shape)}, expected [{v.shape[0]}, 1, 1]"
            )
        if fold:  # weight = g * v / |v|, the norm over every dim but 0 (also for transposed convs)
            v32 = v.float()
            v = v32 * (g.float().reshape(-1, *[1] * (v.ndim - 1)) / _norm_except_dim0(v32))
        sd[base + ".weight"], source[base + ".weight"] = v, [partner, key]
    return sd, source, unused


def _missing(key: str, weight_norm: bool, why: str = "") -> ValueError:
    also = ""
    if weight_norm:
        also = f", nor its weight-norm forms {key}_g/_v or {key[:-7]}.parametrizations.weight.original0/1"
    return ValueError(f"codec checkpoint: tensor {key!r} is missing{why}{also}")


def _shape(sd: dict[str, Tensor], key: str, ndim: int) -> tuple[int, ...]:
    if key not in sd:
        raise _missing(key, key.endswith("conv.weight"), " (needed to infer the codec config)")
    if sd[key].ndim != ndim:
        raise ValueError(f"codec checkpoint: tensor {key!r} has shape {tuple(sd[key].shape)}, expected {ndim} dims")
    return tuple(sd[key].shape)


def _count(sd: dict[str, Tensor], prefix: str) -> int:
    """1 + the largest index i among keys `{prefix}{i}.*` (0 if none)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = [int(m.group(1)) for k in sd if (m := pattern.match(k))]
    return max(found) + 1 if found else 0


def _heads(sd, key, head_dim) -> int:
    rows = _shape(sd, key, 2)[0]
    if rows % (3 * head_dim):
        raise ValueError(f"codec checkpoint: tensor {key!r} has {rows} rows, not a multiple of 3 x head_dim {head_dim}")
    return rows // (3 * head_dim)


def _infer_config(sd: dict[str, Tensor], overrides: dict) -> CodecConfig:
    base = replace(CodecConfig(), **overrides) if overrides else CodecConfig()
    hd = base.head_dim

    encoder_dim = _shape(sd, "encoder.block.0.conv.weight", 3)[0]
    n_enc = _count(sd, "encoder.block.") - 3  # conv, blocks..., snake, conv
    if n_enc < 1:
        raise ValueError("codec checkpoint: no encoder blocks found under 'encoder.block.'")
    enc_rates, enc_layers, ffn_mult = [], [], base.encoder_transformer_ffn_mult
    for i in range(n_enc):
        p = f"encoder.block.{i + 1}.block."
        enc_rates.append(_shape(sd, p + "4.conv.weight", 3)[2] // 2)
        n_layer = _count(sd, p + "5.layers.")
        enc_layers.append(n_layer)
        if n_layer:
            dim = encoder_dim * 2 ** (i + 1)
            wqkv = p + "5.layers.0.attention.wqkv.weight"
            if _heads(sd, wqkv, hd) * hd != dim:
                raise ValueError(f"codec checkpoint: tensor {wqkv!r} does not match the block's {dim} channels")
            ffn_mult = _shape(sd, p + "5.layers.0.feed_forward.w1.weight", 2)[0] // dim
    latent_dim = _shape(sd, f"encoder.block.{n_enc + 2}.conv.weight", 3)[0]

    decoder_dim = _shape(sd, "decoder.model.0.conv.weight", 3)[0]
    n_dec = _count(sd, "decoder.model.") - 3  # conv, blocks..., snake, conv
    if n_dec < 1:
        raise ValueError("codec checkpoint: no decoder blocks found under 'decoder.model.'")
    dec_rates = [_shape(sd, f"decoder.model.{i + 1}.block.1.conv.weight", 3)[2] // 2 for i in range(n_dec)]

    q = "quantizer."
    semantic_size, codebook_dim = _shape(sd, q + "semantic_quantizer.quantizers.0.codebook.weight", 2)
    n_codebooks = _count(sd, q + "quantizer.quantizers.")
    codebook_size = _shape(sd, q + "quantizer.quantizers.0.codebook.weight", 2)[0]
    n_down = _count(sd, q + "downsample.")
    factors = [_shape(sd, f"{q}downsample.{i}.0.conv.weight", 3)[2] for i in range(n_down)]
    convnext_hidden = _shape(sd, q + "downsample.0.1.pwconv1.weight", 2)[0]
    convnext_kernel = _shape(sd, q + "downsample.0.1.dwconv.conv.weight", 3)[2]
    pre_layers = _count(sd, q + "pre_module.layers.")
    post_layers = _count(sd, q + "post_module.layers.")
    for name in ("pre_module", "post_module"):
        wqkv = f"{q}{name}.layers.0.attention.wqkv.weight"
        if _heads(sd, wqkv, hd) * hd != latent_dim:
            raise ValueError(f"codec checkpoint: tensor {wqkv!r} does not match latent_dim {latent_dim}")
    intermediate = _shape(sd, q + "post_module.layers.0.feed_forward.w1.weight", 2)[0]

    return replace(
        base,
        encoder_dim=encoder_dim,
        encoder_rates=tuple(enc_rates),
        encoder_transformer_layers=tuple(enc_layers),
        encoder_transformer_ffn_mult=ffn_mult,
        latent_dim=latent_dim,
        decoder_dim=decoder_dim,
        decoder_rates=tuple(dec_rates),
        n_codebooks=n_codebooks,
        codebook_size=codebook_size,
        semantic_codebook_size=semantic_size,
        codebook_dim=codebook_dim,
        downsample_factor=tuple(factors),
        convnext_mult=convnext_hidden // latent_dim,
        convnext_kernel=convnext_kernel,
        quantizer_pre_layers=pre_layers,
        quantizer_post_layers=post_layers,
        quantizer_intermediate_size=intermediate,
    )


def load_codec(path_or_state_dict, device="cpu", dtype=torch.float32, **config_overrides) -> DAC:
    """Load an official `codec.pth` (or a state dict). The config is inferred from tensor shapes;
    `config_overrides` set the fields that shapes cannot tell (sample_rate, head_dim, windows, ...)."""
    if isinstance(path_or_state_dict, (str, Path)):
        try:
            raw = torch.load(path_or_state_dict, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) files cannot be memory-mapped
            raw = torch.load(path_or_state_dict, map_location="cpu", weights_only=True)
    else:
        raw = path_or_state_dict
    if not isinstance(raw, dict):
        raise ValueError(f"codec checkpoint: expected a state dict, got {type(raw).__name__}")

    sd, source, unused = _normalise(raw)
    config = _infer_config(sd, config_overrides)
    model = on_meta(lambda: DAC(config))

    wanted = model.state_dict()
    missing = [k for k in wanted if k not in sd]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _missing(missing[0], missing[0] in _weight_norm_keys(model), more)
    bad = [k for k, t in wanted.items() if sd[k].shape != t.shape]
    if bad:
        # a folded weight is reported under the key it is stored as (weight_v / original1)
        msgs = [f"{source[k][-1]!r} has shape {tuple(sd[k].shape)}, expected {tuple(wanted[k].shape)}" for k in bad[:3]]
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ValueError("codec checkpoint: tensor " + "; tensor ".join(msgs) + more)
    unused += [stored for k in sd if k not in wanted for stored in source[k]]
    if unused:
        log.info("codec: ignoring %d unused tensors: %s", len(unused), ", ".join(sorted(unused)))

    model.load_state_dict({k: sd[k] for k in wanted}, assign=True)
    model = model.to(device=device, dtype=dtype)
    return model.eval().requires_grad_(False)


CODEC_FILE = "codec.pth"


def codec_dtype_for(setting: str, device, part: str) -> str:
    """The codec precision a `codec_dtype` setting means for `part` ("decoder" | "encoder") on `device`: `auto` is
    fp16 for the decoder on a GPU (`StreamDecoder` decodes a chunk that overflows again in fp32), fp32 otherwise."""
    if setting != "auto":
        return setting
    return "fp16" if part == "decoder" and resolve_device(device).type == "cuda" else "fp32"


def _codec_file(path: str | Path) -> Path:
    f = Path(path) / CODEC_FILE
    if not f.is_file():
        raise CheckpointError(f"{f} not found: the checkpoint directory needs the DAC codec weights {CODEC_FILE}")
    return f


def load_codec_from_dir(path: str | Path, device="cpu", dtype: str | torch.dtype = "fp32"):
    f = _codec_file(path)
    return load_codec(str(f), device=resolve_device(device), dtype=parse_dtype(dtype))


def codec_frame_seconds(path: str | Path) -> float:
    """Seconds of audio per codec frame (2048 / 44100 for S2 Pro), from codec.pth's tensor shapes without
    building the codec (the file is memory-mapped)."""
    f = _codec_file(path)
    config = config_from_state_dict(torch.load(str(f), map_location="cpu", mmap=True, weights_only=True))
    return config.frame_length / config.sample_rate


def codec_codebook_sizes(path: str | Path) -> tuple[int, int]:
    """(semantic, residual) codebook sizes of the checkpoint's codec.pth, read from tensor shapes
    without building the codec (the file is memory-mapped)."""
    f = _codec_file(path)
    sd = torch.load(str(f), map_location="cpu", mmap=True, weights_only=True)
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    sizes = []
    for suffix in ("quantizer.semantic_quantizer.quantizers.0.codebook.weight", "quantizer.quantizer.quantizers.0.codebook.weight"):
        hits = [v for k, v in sd.items() if k.endswith(suffix)]
        if not hits:
            raise CheckpointError(f"{f}: tensor {suffix} is missing")
        sizes.append(int(hits[0].shape[0]))
    return sizes[0], sizes[1]
