# SPDX-License-Identifier: GPL-3.0-or-later
"""Compressed weights for the Memory Pool: Linear and Conv2d layers whose weights are kept as
INT8 with one fp32 scale per output channel (half the bytes of fp16), dequantized into the
input's dtype just before each use.

Plain PyTorch, no ComfyUI import; ``nodes/memory_pool.py`` swaps these modules into a
ComfyUI model through ModelPatcher object patches (the original modules are put back when the
model is unpatched).

Dequantization is one elementwise kernel per layer call (``kernels.dequant_rows``: the int8
weight times its row's scale, written straight into a tensor of the input's dtype): it reads 1
byte and writes 2 per weight. PyTorch's own mixed-dtype ``mul`` did the same at about a fifth
of the bandwidth on the H200 (+7.4 ms per SD1.5 step with two ControlNets), hence the kernel. The
dequantized weight is a temporary: the caching allocator (or a CUDA graph's pool) reuses its
memory for the next layer, so at most a layer or two of fp16 weights exist at any time.

Error: symmetric rounding to 255 levels per output channel, |w − ŵ| ≤ scale/2 with scale =
max|w_row| / 127 (tested). When a layer's int8 weight lives on another device than its input
(ComfyUI's low-VRAM mode keeps some layers on the CPU) it is copied per call, as ComfyUI does
for fp16 weights, at half the bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels

# Layers smaller than this stay as they are: their bytes do not matter and they are often
# precision-critical (time embeddings, small projections).
MIN_NUMEL = 4096


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale of shape (out, 1, ...)): symmetric per output channel."""
    w32 = w.detach().float()
    amax = w32.reshape(w32.shape[0], -1).abs().amax(dim=1)
    scale = (amax / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    scale = scale.reshape((-1,) + (1,) * (w.dim() - 1))
    q = torch.round(w32 / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The weight in ``dtype`` on ``device``: one multiply-and-convert kernel (the pack's
    vectorized ``dequant_rows`` on CUDA, PyTorch's mixed-dtype ``mul`` elsewhere)."""
    if q.device != device:
        q = q.to(device, non_blocking=True)
        scale = scale.to(device, non_blocking=True)
    return kernels.dequant_rows(q, scale, dtype)


class _Int8Weight(torch.nn.Module):
    """Shared part: int8 weight + scale as (frozen) parameters, so ComfyUI's loader moves and
    counts them like any weight; the bias as it was."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = quantize_per_channel(weight)
        self.q = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.weight_dtype = weight.dtype  # what the original held (for reports)
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.bias = None

    def _weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = dequantize(self.q, self.scale, x.dtype, x.device)
        b = self.bias
        if b is not None and (b.dtype != x.dtype or b.device != x.device):
            b = b.to(device=x.device, dtype=x.dtype, non_blocking=True)
        return w, b

    def compressed_bytes(self) -> int:
        n = self.q.numel() + self.scale.numel() * 4
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def original_bytes(self) -> int:
        n = self.q.numel() * torch.empty((), dtype=self.weight_dtype).element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())


class Int8Linear(_Int8Weight):
    def __init__(self, layer: torch.nn.Linear, weight=None, bias=None):
        super().__init__(
            layer.weight if weight is None else weight, layer.bias if bias is None else bias
        )
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._weights(x)
        return F.linear(x, w, b)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Conv2d(_Int8Weight):
    def __init__(self, layer: torch.nn.Conv2d, weight=None, bias=None):
        if layer.padding_mode != "zeros":
            raise ValueError(f"padding_mode {layer.padding_mode!r} is not supported")
        super().__init__(
            layer.weight if weight is None else weight, layer.bias if bias is None else bias
        )
        self.stride, self.padding = layer.stride, layer.padding
        self.dilation, self.groups = layer.dilation, layer.groups
        self.in_channels, self.out_channels = layer.in_channels, layer.out_channels
        self.kernel_size = layer.kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._weights(x)
        # the conv's memory format follows the input (channels_last inputs stay channels_last)
        return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}, int8"
        )


def why_not(module: torch.nn.Module) -> str | None:
    """None if ``module`` can be compressed, else why not."""
    if type(module).__name__.startswith("Int8"):
        return "already compressed"
    if isinstance(module, torch.nn.Conv2d):
        if module.padding_mode != "zeros":
            return f"padding_mode {module.padding_mode}"
    elif not isinstance(module, torch.nn.Linear):
        return "not a Linear or Conv2d"
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        return "no floating-point weight"
    if w.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"weight dtype {w.dtype}"
    if w.numel() < MIN_NUMEL:
        return "small"
    if w.is_meta:
        return "weight not loaded"
    for attr in ("weight_function", "bias_function"):
        if getattr(module, attr, None):
            return "weight is patched per call (LoRA in low-VRAM mode or a wrapper)"
    return None


def compress(module: torch.nn.Module, weight=None, bias=None) -> torch.nn.Module:
    """The int8 replacement of a Linear or Conv2d (see ``why_not``); ``weight`` / ``bias``
    stand in for the module's own (e.g. the unpatched originals while a LoRA is applied)."""
    reason = why_not(module)
    if reason is not None:
        raise ValueError(f"cannot compress {type(module).__name__}: {reason}")
    if isinstance(module, torch.nn.Conv2d):
        return Int8Conv2d(module, weight, bias)
    return Int8Linear(module, weight, bias)


def candidates(root: torch.nn.Module, skip=lambda name: False) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every compressible layer under ``root``, in module order."""
    return [(n, m) for n, m in root.named_modules() if n and not skip(n) and why_not(m) is None]
