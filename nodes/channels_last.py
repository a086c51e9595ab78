# SPDX-License-Identifier: GPL-3.0-or-later
"""Channels-last convolution weights for the length of one sampling run (experimental).

Why: on Hopper, cuDNN runs fp16 convolutions in NHWC. With ComfyUI's NCHW tensors it converts
around every convolution; at SD1.5 512² those conversions are 4.5 of the 16.5 GPU-ms of a step
(``docs/benchmarks.md``, per-op profile), and most of the bytes are the weights, converted anew
at every step. With the weights in channels-last, PyTorch hands cuDNN NHWC tensors directly
(converting only the activations, with its own copy kernels).

How: at the first model call of a run, the Conv2d weights of the UNet and of the ControlNets
are permuted to channels-last *in place* (same storage: the weight addresses that CUDA graphs
captured stay valid, and no second copy of the weights is kept), and permuted back when the run
ends, whatever way it ends. Between runs the weights are exactly as ComfyUI left them, so other
workflows sharing them never see the change; values never change, only their order in memory.
Off by default until measured on a GPU.
"""

from __future__ import annotations

import torch

DEVICES = ("cuda",)  # where the layout helps; tests add "cpu"


def relayout_(w: torch.Tensor, fmt: torch.memory_format) -> bool:
    """Permute a dense 4-D tensor's storage to ``fmt`` in place; True if it changed."""
    if w.dim() != 4 or w.is_contiguous(memory_format=fmt):
        return False
    if not (w.is_contiguous() or w.is_contiguous(memory_format=torch.channels_last)):
        return False  # not dense in either layout (a view): leave it alone
    # ComfyUI loads weights under inference mode (inference tensors may only be updated in
    # place inside it); others are updated under no_grad.
    with torch.inference_mode(w.is_inference()), torch.no_grad():
        tmp = w.detach().contiguous(memory_format=fmt)
        view = w.detach().as_strided(tmp.shape, tmp.stride(), w.storage_offset())
        view.copy_(tmp)
        w.data = view
    return True


class LayoutSwap:
    """The weights put into channels-last during one run, to be put back by ``restore``."""

    def __init__(self):
        self.converted: list[torch.Tensor] = []
        self.modules: set[int] = set()

    def seen(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` was converted, or left alone, in this run already."""
        return id(module) in self.modules

    def leave(self, module: torch.nn.Module) -> None:
        """Leave ``module``'s weights as they are for this run (ComfyUI moves them)."""
        self.modules.add(id(module))

    def ensure(self, module: torch.nn.Module | None) -> int:
        """Convert ``module``'s Conv2d weights (once per run); returns how many changed."""
        if module is None or id(module) in self.modules:
            return 0
        self.modules.add(id(module))
        n = 0
        for m in module.modules():
            if not isinstance(m, torch.nn.Conv2d):
                continue
            w = getattr(m, "weight", None)
            if not isinstance(w, torch.Tensor) or w.device.type not in DEVICES:
                continue
            if relayout_(w, torch.channels_last):
                self.converted.append(w)
                n += 1
        return n

    def restore(self) -> None:
        for w in self.converted:
            relayout_(w, torch.contiguous_format)
        self.converted.clear()
        self.modules.clear()
