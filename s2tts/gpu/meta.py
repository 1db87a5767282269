"""Modules built on PyTorch's meta device: their structure (names, shapes, dtypes) without storage, for a loader that
checks a checkpoint against it and then assigns the loaded tensors (`load_state_dict(..., assign=True)`)."""

import threading

import torch
from torch import nn

# torch.nn.init's functions that modules' reset_parameters call: on a meta tensor there is nothing to initialize, and
# PyTorch runs normal_ on one through torch._refs, whose first call imports torch._dynamo (~2 s of CPU in every
# process that loads a model)
_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
          "xavier_normal_", "constant_", "zeros_", "ones_")
_lock = threading.Lock()


def _skip(tensor, *args, **kwargs):
    return tensor


def on_meta(build):
    """`build()` (a module's constructor) run on the meta device with torch.nn.init's initializers skipped. The
    initializers are swapped process-wide for the call: another thread that initializes a real module at that moment
    would skip its initialization too (loaders build their modules before they serve)."""
    with _lock:
        saved = {name: getattr(nn.init, name) for name in _INITS}
        try:
            for name in _INITS:
                setattr(nn.init, name, _skip)
            with torch.device("meta"):
                return build()
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)
