# SPDX-License-Identifier: GPL-3.0-or-later
"""A Linear layer's matrix multiply that reads its INT8 weight directly (W8A16): the Memory
Pool's INT8 Linear without the fp16 copy of the weight.

    y = x @ (q · scale)ᵀ + bias      x (M, K) fp16/bf16, q (N, K) int8, scale (N,) float32

Expanding an INT8 weight to fp16 before each call (``dequant_rows``) moves 3 bytes per weight
(1 read, 2 written) on top of the 2 the matrix multiply reads back: at SDXL's 5 G weights a
step that traffic alone is about 5% of the step. This kernel reads the 1 byte only, converts
the weight tile to the input's dtype in registers and multiplies in fp32 accumulators; the
per-row scale and the bias are applied to the accumulator, then rounded once.

Written in Triton (shipped with PyTorch's CUDA builds on Linux; ``triton-windows``), compiled
on first use per configuration and cached on disk by Triton. The weight is the left operand
(``acc[n, m] = Σ_k w[n, k] · x[m, k]``): on Hopper the tensor cores take the left operand
from registers, where the conversion leaves it, and the activations from shared memory;
the small token counts of cross-attention's context (77–154 rows) then fit a narrow tile.

On the H200 it is slower than the expansion followed by cuBLAS's fp16 GEMM at almost every SD
shape (docs/benchmarks.md, Kernels): cuBLAS's GEMM outruns this kernel by far more than the
expansion costs. It is therefore not chosen by default (``registry.VALIDATED_TRITON``);
``CNA_KERNELS=cuda`` selects it.

Numerics against the expansion path: the weight times its scale is not rounded to fp16 here
(it is exact in fp32), so results differ from ``F.linear(x, dequant_rows(q, s))`` by the
expansion's own fp16 rounding, a few units in the last place of the output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .constraints import CUDA_LIMITS


class Config(NamedTuple):
    """One tile shape: weight rows (BN) × tokens (BM) × depth (BK) per program, warps, stages."""

    bn: int
    bm: int
    bk: int
    warps: int
    stages: int
    group: int = 8


def default_config(m: int, n: int, k: int, dtype: torch.dtype = torch.float16) -> Config:
    """The tile for an (M tokens, N outputs, K inputs) call: narrow in M for few tokens (the
    weight read dominates), square 128 tiles for the large token counts of 512²–1024² images.

    bfloat16 keeps 4 warps on the square tile: with 8 (Triton 3.6, an H100) the kernel now and
    then wrote wrong values in bfloat16, non-finite or far off, not in the same calls from one
    run to the next (4 of 12 calls at 2048×10240×1280, with 3 or 4 pipeline stages); float16
    with 8 warps and bfloat16 with 4 did not."""
    if m <= 32:
        return Config(64, 32, 128, 4, 4)
    if m <= 64:
        return Config(64, 64, 128, 4, 4)
    if m <= 256:
        return Config(128, 64, 64, 4, 4)
    return Config(128, 128, 64, 4 if dtype == torch.bfloat16 else 8, 4)


def problem(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias) -> str | None:
    """Why the kernel cannot take these arguments, or None (checked before each launch)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"input dtype {x.dtype} (the kernel takes float16 and bfloat16)"
    if q.dtype != torch.int8 or q.dim() != 2:
        return "weight is not a 2-D int8 tensor"
    if x.shape[-1] != q.shape[1]:
        return f"input has {x.shape[-1]} features, the weight {q.shape[1]}"
    k_multiple = CUDA_LIMITS["int8_linear"]["k_multiple"]  # tl.dot's smallest depth
    if x.shape[-1] % k_multiple:
        return f"{x.shape[-1]} input features (the kernel needs a multiple of {k_multiple})"
    if scale.dtype != torch.float32 or scale.numel() != q.shape[0]:
        return "scale is not one float32 value per output"
    if bias is not None and (bias.numel() != q.shape[0] or bias.dtype != x.dtype):
        return "bias is not one value per output in the input's dtype"
    devs = {x.device, q.device, scale.device} | ({bias.device} if bias is not None else set())
    if len(devs) != 1:
        return "input, weight, scale and bias on different devices"
    if x.device.type != "cuda":
        return f"tensors on {x.device.type}"
    if torch.cuda.get_device_capability(x.device) < (8, 0):
        return "GPU older than compute capability 8.0"
    if not q.is_contiguous() or x.numel() == 0:
        return "weight not contiguous or empty input"
    return None


@functools.cache
def triton_missing() -> str | None:
    """Why Triton cannot be used in this process, or None."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable
        return f"Triton is not importable ({type(e).__name__}: {e})"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16_kernel(
        x_ptr, q_ptr, s_ptr, b_ptr, y_ptr,
        M, N, K,
        sxm, sxk, sqn, sqk, sym, syn,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
        BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        grid_n = tl.cdiv(N, BN)
        grid_m = tl.cdiv(M, BM)
        # Programs in groups of GROUP weight-row tiles walk the token tiles together, so a
        # token tile is read from L2 while GROUP weight tiles use it.
        width = GROUP * grid_m
        first_n = (pid // width) * GROUP
        size_n = min(grid_n - first_n, GROUP)
        pid_n = first_n + (pid % width) % size_n
        pid_m = (pid % width) // size_n

        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        # Out-of-range rows and tokens read a valid row instead (no mask in the loop) and
        # are never stored.
        rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BN), BN)
        rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BM), BM)
        q_ptrs = q_ptr + rn[:, None] * sqn + offs_k[None, :] * sqk
        x_ptrs = x_ptr + rm[None, :] * sxm + offs_k[:, None] * sxk

        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                w = tl.load(q_ptrs)
                xt = tl.load(x_ptrs)
            else:
                left = K - k * BK
                w = tl.load(q_ptrs, mask=offs_k[None, :] < left, other=0)
                xt = tl.load(x_ptrs, mask=offs_k[:, None] < left, other=0.0)
            acc = tl.dot(w.to(xt.dtype), xt, acc)
            q_ptrs += BK * sqk
            x_ptrs += BK * sxk

        acc = acc * tl.load(s_ptr + rn)[:, None]
        if HAS_BIAS:
            acc = acc + tl.load(b_ptr + rn).to(tl.float32)[:, None]
        y = tl.trans(acc.to(y_ptr.dtype.element_ty))  # (BM, BN)
        y_ptrs = y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn
        tl.store(y_ptrs, y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))

    return w8a16_kernel


def linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """``x @ (q · scale)ᵀ + bias`` for x (..., K); the caller has checked ``problem``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n = q.shape[0]
    cfg = config or default_config(m, n, k, x.dtype)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = scale.reshape(n)
    grid = (((n + cfg.bn - 1) // cfg.bn) * ((m + cfg.bm - 1) // cfg.bm),)
    _kernel()[grid](
        x2, q, s, bias if bias is not None else s, y,
        m, n, k,
        x2.stride(0), x2.stride(1), q.stride(0), q.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=k % cfg.bk == 0,
        BN=cfg.bn, BM=cfg.bm, BK=cfg.bk, GROUP=cfg.group,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return y.reshape(*lead, n)
