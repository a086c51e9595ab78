# SPDX-License-Identifier: GPL-3.0-or-later
"""The feed-forward projection of SD's transformer blocks with its GEGLU in the epilogue:

    h = x @ wᵀ + b;  value, gate = h.chunk(2, -1);  y = value · gelu(gate)

    x (M, K) fp16/bf16, w (2N, K), b (2N,) in x's dtype, y (M, N)

In stock ComfyUI (and in inductor's code for the same lines) the projection writes the whole
(M, 2N) result, and a second kernel reads it back to write the (M, N) output: at SDXL 1024² the
second kernel alone is about 5% of a compiled step. Here each program computes the same output
tile of the value and the gate halves (two accumulators over the same activation tile) and
stores only ``value · gelu(gate)``: the (M, 2N) intermediate is never written.

Written in Triton (shipped with PyTorch's CUDA builds on Linux), compiled on first use per
configuration and cached on disk by Triton. It competes with cuBLAS's GEMM, which the plain
path uses: whether it pays at SD's shapes is a measurement (``python benchmark.py --kernels
--only geglu_linear``, docs/benchmarks.md, *Kernels*).

Numerics: the value and the gate stay in fp32 until the product is rounded once, where the
plain path rounds the projection to fp16 first; results differ by that rounding (GELU is the
exact, erf form, as ``F.gelu``'s default).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .int8_matmul import triton_missing  # noqa: F401 (one check for the pack's Triton kernels)


class Config(NamedTuple):
    """One tile shape: tokens (BM) × outputs (BN, of each half) × depth (BK) per program."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    group: int = 8
    # tiles moved by the tensor memory accelerator, a fixed number of programs (Hopper and
    # later; where the operands' alignment allows it, else the pointer kernel runs this tile)
    tma: bool = False


def default_config(m: int, n: int, k: int) -> Config:
    """Two fp32 accumulators per program. Measured on an H100 at SD's shapes
    (docs/benchmarks.md, *GEGLU in the feed-forward projection*): 128 × 128 moved by the
    tensor memory accelerator, in 4 stages, where that still makes at least 512 tiles (about
    four waves of programs), else 128 × 64 by pointers; few tokens take a narrower tile."""
    if m <= 64:
        return Config(64, 64, 64, 4, 4)
    if ((m + 127) // 128) * ((n + 127) // 128) >= 512:
        return Config(128, 128, 64, 8, 4, 8, True)
    return Config(128, 64, 64, 8, 3)


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The plain path, as ComfyUI's ``GEGLU`` computes it."""
    value, gate = F.linear(x, w, b).chunk(2, dim=-1)
    return value * F.gelu(gate)


def problem(x: torch.Tensor, w: torch.Tensor, b) -> str | None:
    """Why the kernel cannot take these arguments, or None (checked before each launch)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"input dtype {x.dtype} (the kernel takes float16 and bfloat16)"
    if w.dtype != x.dtype or w.dim() != 2 or w.shape[0] % 2:
        return "weight is not a 2-D tensor of the input's dtype with an even row count"
    if x.shape[-1] != w.shape[1]:
        return f"input has {x.shape[-1]} features, the weight {w.shape[1]}"
    if x.shape[-1] % 16:
        return f"{x.shape[-1]} input features (the kernel needs a multiple of 16)"
    if b is not None and (b.dtype != x.dtype or b.numel() != w.shape[0]):
        return "bias is not one value per weight row in the input's dtype"
    devs = {x.device, w.device} | ({b.device} if b is not None else set())
    if len(devs) != 1:
        return "input, weight and bias on different devices"
    if x.device.type != "cuda":
        return f"tensors on {x.device.type}"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "GPU older than compute capability 8.0"
    if w.stride(1) != 1 or x.numel() == 0:
        return "weight rows not contiguous or empty input"
    return None


@functools.cache
def _kernel():
    from . import _geglu_triton

    return _geglu_triton.geglu_kernel


@functools.cache
def _kernel_tma():
    from . import _geglu_triton

    return _geglu_triton.geglu_kernel_tma


def _tma_ok(x2: torch.Tensor, w: torch.Tensor, n: int) -> bool:
    """The descriptors' conditions: 16-byte aligned bases and row strides, rows contiguous."""
    if x2.device.type == "cuda" and torch.cuda.get_device_capability(x2.device) < (9, 0):
        return False
    e = x2.element_size()
    return (
        x2.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
        and (x2.stride(0) * e) % 16 == 0
        and (w.stride(0) * e) % 16 == 0
        and (n * e) % 16 == 0
        and x2.stride(1) == 1
    )


@functools.cache
def _programs(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def geglu_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """``value · gelu(gate)`` of ``x @ wᵀ + b`` for x (..., K); the caller has checked
    ``problem``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = w.shape[0] // 2
    cfg = config or default_config(m, n, k)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if cfg.tma and not _tma_ok(x2, w, n):
        # the pointer kernel holds more per stage (its loads are not TMA's): at most 3 stages
        cfg = cfg._replace(tma=False, stages=min(cfg.stages, 3))
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        tiles = ((m + cfg.bm - 1) // cfg.bm) * ((n + cfg.bn - 1) // cfg.bn)
        progs = min(tiles, _programs(x.device.index or 0) if x.is_cuda else 4)
        _kernel_tma()[(progs,)](
            TensorDescriptor.from_tensor(x2, [cfg.bm, cfg.bk]),
            TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk]),
            b if b is not None else w,
            TensorDescriptor.from_tensor(y, [cfg.bm, cfg.bn]),
            m, n, k,
            HAS_BIAS=b is not None,
            BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group, PROGRAMS=progs,
            num_warps=cfg.warps, num_stages=cfg.stages,
        )  # fmt: skip
        return y.reshape(*lead, n)
    grid = (((m + cfg.bm - 1) // cfg.bm) * ((n + cfg.bn - 1) // cfg.bn),)
    _kernel()[grid](
        x2, w, b if b is not None else w, y,
        m, n, k,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=b is not None, EVEN_K=k % cfg.bk == 0,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP=cfg.group,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y.reshape(*lead, n)
