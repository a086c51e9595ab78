# SPDX-License-Identifier: GPL-3.0-or-later
"""Compressed weights for the Memory Pool: Linear and Conv2d layers whose weights are kept as
INT8 with one fp32 scale per output channel (half the bytes of fp16), dequantized into the
input's dtype just before each use.

Plain PyTorch, no ComfyUI import; ``nodes/memory_pool.py`` swaps these modules into a
ComfyUI model through ModelPatcher object patches (the original modules are put back when the
model is unpatched).

Each layer call dequantizes its weight, then runs the stock Linear or Conv2d. A Linear layer
goes through ``kernels.int8_linear``: by default that is this expansion followed by
``F.linear``; with ``CNA_KERNELS=cuda`` it is a Triton kernel reading the INT8 weight directly,
which on the H200 is slower than expanding (docs/benchmarks.md, Kernels). Dequantization is
one elementwise kernel per layer call (``kernels.dequant_rows``: the int8 weight times its
row's scale, written straight into a tensor of the input's dtype): it reads 1 byte and writes 2
per weight, in place on the layer's stream. PyTorch's own mixed-dtype ``mul`` did the same at
about a fifth of the bandwidth on the H200 (+7.4 ms per SD1.5 step with two ControlNets), hence
the kernel. The INT8 layers of one block (a transformer block, a ResBlock) are expanded
together, by one launch when the first of them runs (``ExpansionGroup``,
``kernels.dequant_rows_multi``): each launch has a fixed cost of about a microsecond, and a step
of SDXL with two ControlNets had ~1,400 of them. The expanded weights are temporaries: the
caching allocator (or a CUDA graph's pool) reuses their memory for the next group; a group
holds no more weights than the model's largest INT8 layer, so the working memory is what
expanding that layer alone took.

Error: symmetric rounding to 255 levels per output channel, |w − ŵ| ≤ scale/2 with scale =
max|w_row| / 127 (tested). When a layer's int8 weight lives on another device than its input
(ComfyUI's low-VRAM mode keeps some layers on the CPU) it is copied per call, as ComfyUI does
for fp16 weights, at half the bytes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .. import kernels
from ..logger import logger
from . import prefetch

# Layers smaller than this stay as they are: their bytes do not matter and they are often
# precision-critical (time embeddings, small projections).
MIN_NUMEL = 4096

# INT8 layers cost one expansion kernel per call whatever their size: about 1.7 µs inside a
# CUDA graph on the H200, about what expanding 1.3 M weights at full speed takes (kernel
# microbenchmark). Below SMALL_NUMEL weights (0.5 MiB saved) that fixed cost
# dominates, and an SDXL UNet has 298 such layers holding 4% of its weights: the smallest layers
# stay as loaded, as many as hold at most SMALL_SHARE of the compressible weights (so the
# memory given up is bounded whatever the model). CNA_POOL_SMALL_SHARE overrides the share
# (0 compresses every layer) for measurements.
SMALL_NUMEL = 1 << 19
SMALL_SHARE = 0.04


def small_layers_kept(sizes: dict[str, int], share: float | None = None) -> set[str]:
    """The names, among ``sizes`` (name -> weight elements), of the layers INT8 leaves as loaded:
    those under ``SMALL_NUMEL``, smallest first, while together they hold at most ``share``
    (default ``SMALL_SHARE``) of all the weights in ``sizes``."""
    if share is None:
        env = os.environ.get("CNA_POOL_SMALL_SHARE", "").strip()
        share = float(env) if env else SMALL_SHARE
    budget = share * sum(sizes.values())
    kept: set[str] = set()
    used = 0
    for name, n in sorted(sizes.items(), key=lambda kv: (kv[1], kv[0])):
        if n >= SMALL_NUMEL or used + n > budget:
            break
        kept.add(name)
        used += n
    return kept


# Rows quantized at once: the fp32 temporaries of one chunk stay small (a few MiB) where those
# of the largest SD1.5 layer, quantized whole, were 225 MiB on the GPU (H200 trace).
CHUNK_ELEMENTS = 1 << 20


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale of shape (out, 1, ...)): symmetric per output channel,
    computed a few rows at a time."""
    w2 = w.detach().reshape(w.shape[0], -1)
    rows = max(1, CHUNK_ELEMENTS // max(1, w2.shape[1]))
    q = torch.empty(w2.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w2.shape[0], dtype=torch.float32, device=w.device)
    for r in range(0, w2.shape[0], rows):
        w32 = w2[r : r + rows].float()
        s = (w32.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        scale[r : r + rows] = s
        q[r : r + rows] = torch.round(w32 / s[:, None]).clamp_(-127, 127)
    return q.reshape(w.shape), scale.reshape((-1,) + (1,) * (w.dim() - 1))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """The weight in ``dtype`` on ``device``: one multiply-and-convert kernel (the pack's
    vectorized ``dequant_rows`` on CUDA, PyTorch's mixed-dtype ``mul`` elsewhere)."""
    if q.device != device:
        q = q.to(device, non_blocking=True)
        scale = scale.to(device, non_blocking=True)
    return kernels.dequant_rows(q, scale, dtype)


class _Replaced(torch.nn.Module):
    """A Linear or Conv2d whose weight is kept elsewhere or otherwise (subclasses say how) and
    made into a tensor of the input's dtype for each call; the bias as it was, a parameter, so
    ComfyUI's loader moves and counts it like any weight."""

    def __init__(self, layer: torch.nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.kind = "conv" if isinstance(layer, torch.nn.Conv2d) else "linear"
        if self.kind == "conv":
            if layer.padding_mode != "zeros":
                raise ValueError(f"padding_mode {layer.padding_mode!r} is not supported")
            self.stride, self.padding = layer.stride, layer.padding
            self.dilation, self.groups = layer.dilation, layer.groups
            self.in_channels, self.out_channels = layer.in_channels, layer.out_channels
            self.kernel_size = layer.kernel_size
        else:
            self.in_features, self.out_features = layer.in_features, layer.out_features
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
        else:
            self.bias = None

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _bias_for(self, x: torch.Tensor) -> torch.Tensor | None:
        b = self.bias
        if b is not None and (b.dtype != x.dtype or b.device != x.device):
            b = b.to(device=x.device, dtype=x.dtype, non_blocking=True)
        return b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self._weight_for(x)
        b = self._bias_for(x)
        if self.kind == "conv":
            # the conv's memory format follows the input (channels_last stays channels_last)
            return F.conv2d(x, w, b, self.stride, self.padding, self.dilation, self.groups)
        return F.linear(x, w, b)

    def _bias_bytes(self) -> int:
        return 0 if self.bias is None else self.bias.numel() * self.bias.element_size()

    def extra_repr(self) -> str:
        how = type(self).__name__.replace("Linear", "").replace("Conv2d", "").lower()
        if self.kind == "conv":
            return (
                f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, {how}"
            )
        return f"in_features={self.in_features}, out_features={self.out_features}, {how}"


class _Int8Weight(_Replaced):
    """INT8 weight + fp32 scale per output channel, as (frozen) parameters that ComfyUI's
    loader moves to the GPU; expanded to the input's dtype where the layer runs."""

    def __init__(self, layer, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__(layer, layer.bias if bias is None else bias)
        weight = layer.weight if weight is None else weight  # None: the layer's own
        q, scale = quantize_per_channel(weight)
        self.q = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.weight_dtype = weight.dtype  # what the original held (for reports)

    expansion_group: ExpansionGroup | None = None  # set by ``form_expansion_groups``

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        # Expanded in place, on the layer's stream: with the rest of its block when it has an
        # expansion group, else alone. Expanding one layer ahead on a side stream
        # (memory/prefetch.py) was measured slower under CUDA graphs on the H200: W2 22.16 ->
        # 25.19 ms/step, the ~850 cross-stream dependencies of a step cost more
        # than the copies they hid. A whole group ahead was no faster either (SDXL with 2
        # ControlNets, H100: 84.75 in place, 84.90 ahead): the expansion's traffic is the cost,
        # wherever it runs (docs/benchmarks.md, Memory Pool, Known shortfalls).
        group = self.expansion_group
        if group is not None and not torch.compiler.is_compiling():
            w = group.take(self, x)
            if w is not None:
                return w
        return dequantize(self.q, self.scale, x.dtype, x.device)

    def compressed_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4 + self._bias_bytes()

    def working_bytes(self) -> int:
        """What expanding this layer's weight for a call holds on its device (its group's
        expansion when it has one), at the original dtype's size."""
        size = torch.empty((), dtype=self.weight_dtype).element_size()
        group = self.expansion_group
        return group.expanded_bytes(size) if group is not None else self.q.numel() * size

    def original_bytes(self) -> int:
        n = self.q.numel() * torch.empty((), dtype=self.weight_dtype).element_size()
        return n + self._bias_bytes()


class Int8Linear(_Int8Weight):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q.device != x.device:  # low-VRAM: the weight is copied per call, then expanded
            return super().forward(x)
        if self.expansion_group is not None and not torch.compiler.is_compiling():
            # expanded with its block (never with int8_linear); compiled code expands each
            # layer's weight itself, where the compiler sees it
            return F.linear(x, self._weight_for(x), self._bias_for(x))
        # The expansion then F.linear, as for convolutions; with CNA_KERNELS=cuda one matrix
        # multiply reading the INT8 weight (kernels.int8_linear says which).
        return kernels.int8_linear(x, self.q, self.scale, self._bias_for(x))


class Int8Conv2d(_Int8Weight):
    pass


# An expansion group holds at most as many weights as the model's largest INT8 layer (so the
# pool's working memory is what expanding that layer alone took) and never more than this.
GROUP_MAX_NUMEL = 48 << 20


class ExpansionGroup:
    """The INT8 layers of one block, expanded by one kernel launch when the first of them runs.

    Each expansion launch costs a fixed 1–2 µs on top of its traffic, and a step of SDXL with
    two ControlNets expanded ~1,400 weights one at a time. The group expands all its layers'
    weights into one allocation (``kernels.dequant_rows_multi``) when one of them asks for its
    weight and finds none ready, and hands each layer its view once; the allocation is freed
    when the last view is used. A layer asking again before the others (or one that did not
    run) makes the group expand again: every view holds the expansion of the layer's own INT8
    weight, so whichever a layer gets, its values are the same. Views are handed out only on
    the device, dtype and stream they were made on (a CUDA graph's capture stream is a stream
    of its own), so none crosses into a graph or out of one. Code being compiled by
    torch.compile expands each layer alone: the group's state is the host's, not the graph's.

    The memory: a group holds at most as many weights as the model's largest INT8 layer
    (``form_expansion_groups``), so expanding it takes no more than that layer did alone."""

    def __init__(self, layers: list[_Int8Weight]):
        self._layers = list(layers)
        self._ready: dict[int, torch.Tensor] = {}
        self._key: tuple | None = None

    def __len__(self) -> int:
        return len(self._layers)

    def expanded_bytes(self, element_size: int = 2) -> int:
        """The memory one expansion of the group takes (fp16 by default)."""
        return sum(m.q.numel() for m in self._layers) * element_size

    def release(self) -> None:
        """Drop views made but not used (a layer that did not run): the end of a run."""
        self._ready = {}
        self._key = None

    def take(self, layer: _Int8Weight, x: torch.Tensor) -> torch.Tensor | None:
        """``layer``'s weight expanded to ``x``'s dtype, or None where the group cannot make it
        (a layer's weight not on ``x``'s device: the caller expands it alone)."""
        stream = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else None
        key = (x.device, x.dtype, stream)
        if self._key == key:
            w = self._ready.pop(id(layer), None)
            if w is not None:
                return w
        self._ready = {}
        self._key = None
        if any(m.q.device != x.device for m in self._layers):
            return None
        views = kernels.dequant_rows_multi(
            [m.q for m in self._layers], [m.scale for m in self._layers], x.dtype
        )
        ready = {id(m): v for m, v in zip(self._layers, views, strict=True)}
        w = ready.pop(id(layer), None)
        if w is None:  # not a member (cannot happen through form_expansion_groups)
            return None
        self._ready, self._key = ready, key
        return w


def release_expansions(modules) -> None:
    """``ExpansionGroup.release`` for the groups of the INT8 layers among ``modules``."""
    for m in modules:
        group = getattr(m, "expansion_group", None) if isinstance(m, _Int8Weight) else None
        if group is not None:
            group.release()


def block_of(name: str) -> str:
    """The block a layer belongs to, from its module path: the transformer block
    (``...transformer_blocks.N``), else the UNet block (``input_blocks.I.J``, ``middle_block.J``,
    ``zero_convs.I``), else the layer's parent."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i - 1] == "transformer_blocks" and parts[i].isdigit():
            return ".".join(parts[: i + 1])
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            j = i + 1 if i + 1 < len(parts) - 1 and parts[i + 1].isdigit() else i
            return ".".join(parts[: j + 1])
    return ".".join(parts[:-1])


def form_expansion_groups(layers: list[tuple[str, torch.nn.Module]], device=None) -> int:
    """Give the INT8 layers among ``layers`` (module path, module; in the model's order) an
    ``ExpansionGroup`` per run of layers of one block (``block_of``), each run holding at most
    as many weights as the largest of ``layers`` (and ``GROUP_MAX_NUMEL``): expanding a group
    then takes no more memory than expanding that layer alone did. A layer left alone keeps
    expanding alone. INT8 Linear layers stay out where ``int8_linear`` multiplies with the INT8
    weight directly on ``device`` (they expand nothing). ``CNA_POOL_GROUPS=0`` turns grouping
    off (every layer alone, for measurements). Returns how many groups were formed."""
    linear = kernels.int8_linear_expands(device)
    for _, m in layers:
        if isinstance(m, _Int8Weight):
            m.expansion_group = None
    if os.environ.get("CNA_POOL_GROUPS", "").strip() == "0":
        return 0
    blocks: dict[str, list[_Int8Weight]] = {}
    for name, m in layers:
        if not isinstance(m, _Int8Weight) or (not linear and isinstance(m, Int8Linear)):
            continue
        blocks.setdefault(block_of(name), []).append(m)
    cap = min(
        GROUP_MAX_NUMEL,
        max((m.q.numel() for ms in blocks.values() for m in ms), default=0),
    )
    formed = 0
    for members in blocks.values():
        chunk: list[_Int8Weight] = []
        size = 0
        for m in members + [None]:
            if m is None or (chunk and size + m.q.numel() > cap):
                if len(chunk) > 1:
                    group = ExpansionGroup(chunk)
                    for c in chunk:
                        c.expansion_group = group
                    formed += 1
                chunk, size = [], 0
            if m is not None:
                chunk.append(m)
                size += m.q.numel()
    return formed


class _StreamedWeight(_Replaced):
    """The weight, unchanged, in pinned host memory instead of VRAM (not a parameter or
    buffer: ComfyUI's loader leaves it where it is and does not count it), copied to the GPU
    for each call, one layer ahead on a side stream (``prefetch.py``) so the copy overlaps the
    layer before. Lossless: the layer computes with the very values it was loaded with."""

    def __init__(self, layer, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        super().__init__(layer, layer.bias if bias is None else bias)
        weight = layer.weight if weight is None else weight
        host = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
        if torch.cuda.is_available():
            try:
                host = host.pin_memory()  # asynchronous copies, capturable in a CUDA graph
            except RuntimeError as e:  # no room for page-locked memory: pageable, synchronous
                _warn_pageable(e)
        host.copy_(weight.detach())
        self.host_weight = host
        self.weight_dtype = weight.dtype

    def _weight_for(self, x: torch.Tensor) -> torch.Tensor:
        return prefetch.weight(self, x)

    # the prefetch lane's interface
    def expand_weight(self, dtype: torch.dtype, device) -> torch.Tensor:
        w = self.host_weight.to(device, non_blocking=self.host_weight.is_pinned())
        return w if w.dtype == dtype else w.to(dtype)

    def empty_weight(self, dtype: torch.dtype, device) -> torch.Tensor | None:
        pageable = torch.device(device).type == "cuda" and not self.host_weight.is_pinned()
        if dtype != self.weight_dtype or pageable:
            return None  # cast per call / synchronous copy: done where the layer runs
        return torch.empty(self.host_weight.shape, dtype=dtype, device=device)

    def expand_weight_into(self, out: torch.Tensor) -> None:
        out.copy_(self.host_weight, non_blocking=True)

    def compressed_bytes(self) -> int:  # what stays in VRAM
        return self._bias_bytes()

    def original_bytes(self) -> int:
        return self.host_weight.numel() * self.host_weight.element_size() + self._bias_bytes()


_pageable_warned = False


def _warn_pageable(err: Exception) -> None:
    global _pageable_warned
    if not _pageable_warned:
        _pageable_warned = True
        logger.warning(
            "ControlNet Memory Pool: the system could not page-lock RAM for streamed weights "
            "(%s); they are copied synchronously instead, slower, and the CUDA Graph node runs "
            "those steps eager. Free some RAM, or set the Memory Pool's weights to 'int8'.",
            err,
        )


class StreamedLinear(_StreamedWeight):
    pass


class StreamedConv2d(_StreamedWeight):
    pass


def why_not(module: torch.nn.Module) -> str | None:
    """None if ``module`` can be compressed, else why not."""
    if isinstance(module, _Replaced):
        return "already compressed or streamed"
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


def compress(module: torch.nn.Module, weight=None, bias=None, mode: str = "int8"):
    """The replacement of a Linear or Conv2d (see ``why_not``): ``mode`` "int8" (INT8 in VRAM)
    or "stream" (as loaded, in pinned host memory); ``weight`` / ``bias`` stand in for the
    module's own (e.g. the unpatched originals while a LoRA is applied)."""
    reason = why_not(module)
    if reason is not None:
        raise ValueError(f"cannot compress {type(module).__name__}: {reason}")
    conv = isinstance(module, torch.nn.Conv2d)
    if mode == "int8":
        return (Int8Conv2d if conv else Int8Linear)(module, weight, bias)
    if mode == "stream":
        return (StreamedConv2d if conv else StreamedLinear)(module, weight, bias)
    raise ValueError(f"unknown mode {mode!r}")
