# SPDX-License-Identifier: GPL-3.0-or-later
"""Plain-PyTorch implementations of every op: the CPU path and the fallback when the CUDA
extension cannot be built. Each computes in float32 and rounds once, as the CUDA kernels do."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def control_merge(
    residuals: list[list[torch.Tensor]], strengths: torch.Tensor
) -> list[torch.Tensor]:
    """out[k] = Σ_i strengths[i] · residuals[i][k]; residuals: N nets × K slots, same shapes
    per slot; strengths: (N,) float32. Returns K tensors in the residuals' dtype (the promoted
    one where nets differ, as stock ComfyUI's sum gives)."""
    n = len(residuals)
    s = strengths.to(torch.float32)
    out = []
    for k in range(len(residuals[0])):
        acc = residuals[0][k].float() * s[0]
        dtype = residuals[0][k].dtype
        for i in range(1, n):
            acc = acc + residuals[i][k].float() * s[i]
            dtype = torch.promote_types(dtype, residuals[i][k].dtype)
        out.append(acc.to(dtype))
    return out


def control_merge_add_(
    hidden: list[torch.Tensor], residuals: list[list[torch.Tensor]], strengths: torch.Tensor
) -> None:
    """hidden[k] += Σ_i strengths[i] · residuals[i][k], in place, one rounding."""
    s = strengths.to(torch.float32)
    for k, h in enumerate(hidden):
        acc = h.float()
        for i in range(len(residuals)):
            acc = acc + residuals[i][k].float() * s[i]
        h.copy_(acc.to(h.dtype))


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-(sample, channel) INT8: x (B, C, *spatial) -> q int8 same shape, scale
    float32 (B, C) with x ≈ q · scale. scale = max|x| / 127 over the spatial dims (0 for an
    all-zero plane, whose q is 0); q = round-half-even(x / scale) clamped to ±127."""
    b, c = x.shape[0], x.shape[1]
    xf = x.float().reshape(b, c, -1)
    amax = xf.abs().amax(dim=2)
    scale = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(x.shape), scale


def dequant_add_(
    hidden: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, strength: torch.Tensor
) -> None:
    """hidden += strength · q · scale[b, c], in place, computed in float32, one rounding."""
    b, c = hidden.shape[0], hidden.shape[1]
    deq = (strength.float() * scale.float()).reshape(b, c, *([1] * (hidden.dim() - 2))) * q.float()
    hidden.copy_((hidden.float() + deq).to(hidden.dtype))


def dequant_rows(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q · scale[r] in ``dtype``, computed in float32 (one rounding), one fused kernel."""
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    s = scale.float().reshape((-1,) + (1,) * (q.dim() - 1))
    return torch.mul(q, s, out=out)


def group_norm_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, groups: int = 32, eps: float = 1e-5
) -> torch.Tensor:
    """SiLU(GroupNorm(x)): the ResBlock prologue of SD UNets and ControlNets. Affine parameters
    in another dtype than x (fp32 norms on fp16 activations) are cast to x's, as CUDA's
    GroupNorm requires."""
    return group_norm_act(x, weight, bias, groups, eps, silu=True)


def group_norm_act(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    groups: int = 32,
    eps: float = 1e-5,
    silu: bool = False,
) -> torch.Tensor:
    """GroupNorm(x), then SiLU if ``silu``; affine parameters cast to x's dtype."""
    y = F.group_norm(x, groups, weight.to(x.dtype), bias.to(x.dtype), eps)
    return F.silu(y) if silu else y
