"""Builds the reference modded DAC of fish-speech 0.1.0 for parity tests (test helper only).

Needs (pip, --no-deps where noted; torchaudio has no build for our torch, so a stand-in
module is installed into sys.modules before importing):
    pip install --no-deps fish-speech==0.1.0 descript-audio-codec descript-audiotools
    pip install hydra-core omegaconf librosa einops flatten-dict julius ffmpy \
        importlib-resources tensorboard randomname argbind
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path

import torch


def _install_torchaudio_stub() -> None:
    if "torchaudio" in sys.modules:
        return
    try:  # a real torchaudio, if one ever matches the installed torch
        import torchaudio  # noqa: F401

        return
    except Exception:
        sys.modules.pop("torchaudio", None)

    def stub(name: str) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mod.__path__ = []
        sys.modules[name] = mod
        return mod

    root = stub("torchaudio")
    for sub in ("functional", "transforms", "sox_effects", "backend"):
        setattr(root, sub, stub(f"torchaudio.{sub}"))


def _install_tensorboard_stub() -> None:
    """audiotools imports `torch.utils.tensorboard.SummaryWriter` (for training only); the
    installed tensorboard may not match the installed protobuf, so fall back to a stand-in."""
    try:
        import torch.utils.tensorboard  # noqa: F401
    except Exception:
        mod = types.ModuleType("torch.utils.tensorboard")
        mod.SummaryWriter = type("SummaryWriter", (), {})
        sys.modules["torch.utils.tensorboard"] = mod


def import_reference():
    """Returns the `fish_speech` package (raises ImportError if it is not installed)."""
    import fish_speech  # noqa: F401  (ImportError here -> the caller skips)

    _install_torchaudio_stub()
    _install_tensorboard_stub()
    import fish_speech.models.dac.modded_dac  # noqa: F401  (imports dac, audiotools, hydra)

    return fish_speech


# Tiny widths for the reference, same topology as `s2tts.codec.model.tiny_codec_config()` except a
# quantizer window of 8 frames, so short clips already span several attention windows.
TINY_OVERRIDES = {
    "encoder_dim": 8,
    "latent_dim": 64,
    "decoder_dim": 64,
    "encoder_transformer_layers": [0, 0, 0, 1],
    "transformer_general_config.block_size": 1024,  # RoPE/mask tables: longest sequence used
    "quantizer.pre_module.config.block_size": 256,
    "quantizer.post_module.config.block_size": 256,
    "quantizer.input_dim": 64,
    "quantizer.codebook_size": 32,
    "quantizer.semantic_codebook_size": 64,
    "quantizer.pre_module.window_size": 8,
    "quantizer.pre_module.input_dim": 64,
    "quantizer.pre_module.config.n_layer": 1,
    "quantizer.pre_module.config.n_head": 1,
    "quantizer.pre_module.config.dim": 64,
    "quantizer.pre_module.config.intermediate_size": 192,
    "quantizer.post_module.window_size": 8,
    "quantizer.post_module.input_dim": 64,
    "quantizer.post_module.config.n_layer": 2,
    "quantizer.post_module.config.n_head": 1,
    "quantizer.post_module.config.dim": 64,
    "quantizer.post_module.config.intermediate_size": 192,
}


def build_reference_dac(seed: int = 0, overrides: dict | None = None) -> torch.nn.Module:
    """The reference DAC from its own `configs/modded_dac_vq.yaml`, random weights, eval mode.

    `overrides` maps dotted yaml keys to values (e.g. TINY_OVERRIDES).

    The weights are random from the stock init (seeded). The tensors that the stock init sets
    to constants are then randomised (deterministic from `seed`): Snake alphas, LayerScale and
    ConvNeXt gammas, norm weights, biases and weight-norm gains. With the stock values the
    ConvNeXt blocks (gamma 1e-6) would contribute nothing, so a parity test could not see them.
    """
    fish_speech = import_reference()
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    yaml = Path(list(fish_speech.__path__)[0]) / "configs" / "modded_dac_vq.yaml"
    cfg = OmegaConf.load(yaml)
    for key, value in (overrides or {}).items():
        OmegaConf.update(cfg, key, value, merge=False)
    torch.manual_seed(seed)
    model = instantiate(cfg).eval()

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".alpha"):  # Snake
                p.copy_(1.0 + 0.5 * torch.rand(p.shape, generator=gen))
            elif name.endswith(".gamma"):  # LayerScale, ConvNeXt
                p.copy_(0.1 + 0.05 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # RMSNorm, LayerNorm
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 3 and p.shape[1:] == (1, 1):  # weight-norm gain g, per channel
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    return model
