"""Loading a checkpoint directory laid out as the official `fishaudio/s2-pro` release.

    config.json  tokenizer.json  model.safetensors.index.json
    model-0000N-of-0000M.safetensors  codec.pth

Every tensor the model needs is checked (name, shape); a missing or misshaped one
stops loading with an error naming it. Tensors the model does not use are named in
one log line and ignored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..checkpoint_config import CheckpointError, S2Config
from ..gpu.device import parse_dtype, resolve_device
from ..gpu.meta import on_meta
from .model import S2Model, Stack, use_fp8_weights

log = logging.getLogger("s2tts")

INDEX_FILE = "model.safetensors.index.json"
_PREFIX = {"slow": "text_model.model.", "fast": "audio_decoder."}


def checkpoint_name(param_name: str) -> str:
    """Our parameter name -> the checkpoint's tensor name (`slow.stack.layers.0...` -> `text_model.model.layers.0...`)."""
    top, rest = param_name.split(".", 1)
    if rest.startswith("stack."):
        rest = rest[len("stack.") :]
    return _PREFIX[top] + rest


def expected_tensors(s2: S2Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, for every tensor S2 Pro inference needs."""
    model = on_meta(lambda: S2Model(s2))
    return {checkpoint_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def _shard_map(path: Path) -> dict[str, str]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no `weight_map`")
        return weight_map
    single = path / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {k: single.name for k in f.keys()}
    raise CheckpointError(f"{path}: neither {INDEX_FILE} nor model.safetensors found")


def load_model(path: str | Path, device="cpu", dtype: str | torch.dtype = "bf16", parts=("slow", "fast"),
               weights: str = "dtype") -> S2Model:
    """Build S2Model from a checkpoint directory, strictly checked, on `device` in `dtype`.

    `parts=("fast",)` loads only the fast AR (the `fast_ar` model); the rest stays on the meta device.
    `weights="fp8"`: the layers' matrices in FP8 with a scale per row (`model.use_fp8_weights`), the rest in `dtype`.
    """
    if weights not in ("dtype", "fp8"):
        raise ValueError(f"weights={weights!r}: use 'dtype' (as loaded) or 'fp8'")
    from safetensors import safe_open

    path = Path(path)
    device, dtype = resolve_device(device), parse_dtype(dtype)
    s2 = S2Config.from_dir(path)
    if not s2.text.tie_word_embeddings:
        raise CheckpointError("text_config.tie_word_embeddings is false: S2 Pro's slow AR ties its output head to the embeddings")
    prefixes = tuple(_PREFIX[p] for p in parts)
    all_expected = expected_tensors(s2)
    expected = {n: s for n, s in all_expected.items() if n.startswith(prefixes)}
    weight_map = _shard_map(path)

    missing = [n for n in expected if n not in weight_map]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]}" + (f" (and {len(missing) - 1} more: {missing[1:6]})" if len(missing) > 1 else ""))
    unused = sorted(n for n in weight_map if n not in all_expected)
    if unused:
        log.info("checkpoint %s: ignoring %d tensors the model does not use: %s", path, len(unused), ", ".join(unused))

    by_file: dict[str, list[str]] = {}
    for name in expected:
        by_file.setdefault(weight_map[name], []).append(name)
    tensors = {}
    for fname, names in by_file.items():
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"{INDEX_FILE} names shard {fname}, which is not in {path}")
        with safe_open(str(fpath), "pt", device="cpu") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name} is listed in {INDEX_FILE} but missing from {fname}")
                t = f.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    raise CheckpointError(f"tensor {name} has shape {tuple(t.shape)}, expected {expected[name]} from config.json")
                tensors[name] = t.to(device=device, dtype=dtype)

    model = on_meta(lambda: S2Model(s2))
    state = {n: tensors[checkpoint_name(n)] for n, _ in model.named_parameters() if checkpoint_name(n) in expected}
    model.load_state_dict(state, assign=True, strict=len(parts) == 2)
    _materialize_buffers(model, device)
    if "slow" in parts:
        model.slow.build_head()
    if weights == "fp8":
        del tensors, state  # the loaded matrices, replaced: their memory back to the device for the KV pool
        use_fp8_weights(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return model.eval().requires_grad_(False)


def _materialize_buffers(model: S2Model, device) -> None:
    """Non-persistent buffers (RoPE tables) are not loaded: each Stack computed its own on the CPU when it was built
    (`model.rope_table`, even on the meta device); they move to `device`."""
    for m in model.modules():
        if isinstance(m, Stack):
            m.rope = m.rope.to(device)

