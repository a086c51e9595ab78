# SPDX-License-Identifier: GPL-3.0-or-later
"""What each op accepts on each backend, as data.

``CONSTRAINTS``: the devices and dtypes each backend serves (``dtypes: None`` means any floating
dtype the eager math supports). The registry rejects a backend on these before anything runs.

``CUDA_LIMITS``: what one launch of each CUDA kernel can take — counts, slots, sizes, dtypes,
alignment, contiguity — mirroring the constants and ``TORCH_CHECK``s of ``csrc/ops/*.cu``
(a test reads the sources and compares). ``cuda_launch_problem`` checks a call against them
*before* launching; anything outside takes the eager path (``ops.py`` logs it once). Counts the
kernel cannot take in one launch but the op can split (more nets than one launch merges, more
slots than its pointer table holds) are split by ``ops.py`` instead of refused.
"""

from __future__ import annotations

import torch

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)

CONSTRAINTS: dict[str, dict[str, dict]] = {
    "control_merge": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT,)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
    "quantize_int8": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT,)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
    "dequant_add": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT, torch.int8)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
    "dequant_rows": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT, torch.int8)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
    "group_norm_silu": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT,)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
    # A Triton kernel (int8_matmul.py), served with the CUDA backend.
    "int8_linear": {
        "cuda": {"devices": ("cuda",), "dtypes": (*_FLOAT, torch.int8)},
        "eager": {"devices": ("cuda", "cpu", "mps", "xpu"), "dtypes": None},
    },
}

# CUDA's grid limit in x (every architecture the pack builds for).
_GRID_X = 2**31 - 1

CUDA_LIMITS: dict[str, dict] = {
    # control_merge.cu: kMaxNets, kMaxSlots (the pointer table passed by value), one dtype and
    # one device for every residual and output; contiguous tensors (ops.py makes them so).
    "control_merge": {"max_nets": 4, "max_slots": 32},
    # quant_int8.cu: one block per (sample, channel) plane in grid x; dim >= 2.
    "quantize_int8": {"min_dim": 2, "max_planes": _GRID_X},
    # quant_int8.cu: h contiguous (it is written in place), q int8 of h's shape, scale float32
    # (B, C), strength a float32 scalar, all on h's device.
    "dequant_add": {"min_dim": 2},
    # quant_int8.cu: q contiguous int8, scale float32 with one value per row, out of q's shape.
    "dequant_rows": {"min_dim": 1},
    # quant_int8.cu: several weights in one launch, each on the vector path (rows a multiple of
    # 16 elements, 16-byte aligned, under 2^35 elements), all on out's device; any number of
    # weights (the launches take 16 at a time).
    "dequant_rows_multi": {"vec": 16, "max_vectors": 2**31},
    # group_norm_silu.cu: grid x = B * groups, C divisible by groups, weight and bias (C,) in
    # x's dtype; the statistics pass splits a group into at most 64 chunks (kMaxChunks).
    "group_norm_silu": {"min_dim": 2, "max_groups_total": _GRID_X, "max_chunks": 64},
    # int8_matmul.py (Triton): fp16/bf16 input with K a multiple of 16, q a contiguous 2-D
    # int8 weight, scale float32 (one per row), bias in x's dtype, one device, sm_80 or newer.
    "int8_linear": {"k_multiple": 16},
}


def uniform(tensors: list[torch.Tensor]) -> str | None:
    """None if every tensor has the first one's device and dtype, else how they differ."""
    dev, dt = tensors[0].device, tensors[0].dtype
    for t in tensors[1:]:
        if t.device != dev:
            return f"tensors on {dev} and {t.device}"
        if t.dtype != dt:
            return f"mixed dtypes {dt} and {t.dtype}"
    return None


def _affine_problem(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why GroupNorm's weight and bias do not suit the kernel: x's dtype and device, one value
    per channel."""
    if w.dtype != x.dtype or b.dtype != x.dtype:
        return f"weight/bias {w.dtype}/{b.dtype} differ from x's {x.dtype}"
    if w.numel() != x.shape[1] or b.numel() != x.shape[1]:
        return "weight/bias not one value per channel"
    if w.device != x.device or b.device != x.device:
        return "weight/bias on another device than x"
    return None


def cuda_launch_problem(op: str, **a) -> str | None:
    """Why one CUDA launch of ``op`` cannot take these arguments, or None if it can.

    Arguments per op (tensors as the op's public function received them):
    ``control_merge``: residuals (list of nets of slot tensors), outs (hidden tensors for the
    in-place form, else None), strengths; the nets and slots counts here are those of ONE launch.
    ``quantize_int8``: x. ``dequant_add``: hidden, q, scale, strength.
    ``dequant_rows``: q, scale, out. ``dequant_rows_multi``: qs, scales, out (the flat output).
    ``group_norm_silu``: x, weight, bias, groups.
    ``int8_linear``: x, q, scale, bias.
    """
    lim = CUDA_LIMITS[op]
    if op == "control_merge":
        res, outs = a["residuals"], a.get("outs")
        if not 1 <= len(res) <= lim["max_nets"]:
            return f"{len(res)} nets in one launch (the kernel takes 1–{lim['max_nets']})"
        k = len(res[0])
        if not 1 <= k <= lim["max_slots"]:
            return f"{k} slots in one launch (the kernel takes 1–{lim['max_slots']})"
        flat = [r for net in res for r in net] + list(outs or [])
        why = uniform(flat)
        if why:
            return why
        if outs is not None and not all(h.is_contiguous() for h in outs):
            return "a non-contiguous tensor to add into (the kernel writes it in place)"
        if a["strengths"].numel() < len(res):
            return "fewer strengths than nets"
        return None
    if op == "quantize_int8":
        x = a["x"]
        if x.dim() < lim["min_dim"]:
            return f"x has {x.dim()} dims (needs (B, C, ...))"
        if x.shape[0] * x.shape[1] > lim["max_planes"]:
            return f"{x.shape[0] * x.shape[1]} planes (over the grid limit)"
        return None
    if op == "dequant_add":
        h, q, scale = a["hidden"], a["q"], a["scale"]
        if h.dim() < lim["min_dim"]:
            return f"hidden has {h.dim()} dims (needs (B, C, ...))"
        if not h.is_contiguous():
            return "hidden is not contiguous (the kernel writes it in place)"
        if h.dtype not in _FLOAT:
            return f"hidden is {h.dtype}"
        if q.device != h.device or scale.device != h.device or a["strength"].device != h.device:
            return "q, scale, strength and hidden on different devices"
        return None
    if op == "dequant_rows":
        q, scale, out = a["q"], a["scale"], a["out"]
        if q.dim() < lim["min_dim"]:
            return "q is a scalar"
        if not q.is_contiguous():
            return "q is not contiguous"
        if scale.dtype != torch.float32:
            return f"scale is {scale.dtype} (the kernel reads float32)"
        if scale.device != q.device or out.device != q.device:
            return "q, scale and out on different devices"
        if out.dtype not in _FLOAT:
            return f"output dtype {out.dtype}"
        return None
    if op == "dequant_rows_multi":
        out, v = a["out"], lim["vec"]
        if out.dtype not in _FLOAT:
            return f"output dtype {out.dtype}"
        if out.data_ptr() % 16:
            return "the output is not 16-byte aligned"
        for q, scale in zip(a["qs"], a["scales"], strict=True):
            if q.device != out.device or scale.device != out.device:
                return "weights, scales and output on different devices"
            if q.dim() < 1 or not q.is_contiguous() or q.numel() == 0:
                return "a weight is empty, a scalar or not contiguous"
            if (q.numel() // q.shape[0]) % v or q.data_ptr() % 16:
                return f"a weight's rows are not a multiple of {v} elements, or it is unaligned"
            if q.numel() // v >= lim["max_vectors"]:
                return "a weight over 2^35 elements"
            if scale.dtype != torch.float32 or not scale.is_contiguous():
                return f"a scale is {scale.dtype} or not contiguous (the kernel reads float32)"
        return None
    if op == "group_norm_silu":
        x, w, b, groups = a["x"], a["weight"], a["bias"], a["groups"]
        if x.dim() < lim["min_dim"] or groups <= 0 or x.shape[1] % groups:
            return f"x {tuple(x.shape)} with {groups} groups"
        if x.shape[0] * groups > lim["max_groups_total"]:
            return f"{x.shape[0] * groups} groups in all (over the grid limit)"
        return _affine_problem(x, w, b)
    if op == "int8_linear":
        from . import int8_matmul

        return int8_matmul.triton_missing() or int8_matmul.problem(
            a["x"], a["q"], a["scale"], a["bias"]
        )
    raise KeyError(op)
