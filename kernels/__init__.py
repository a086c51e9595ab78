# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's kernels: one CUDA extension, JIT-compiled on first use and cached, with a
plain-PyTorch implementation of every op as the CPU path and the fallback.

Public ops (shapes in their docstrings): ``control_merge``, ``control_merge_add_``,
``quantize_int8``, ``dequant_add_``, ``dequant_rows``, ``dequant_rows_multi``,
``group_norm_silu``, ``int8_linear`` (a Triton kernel, served with the CUDA backend).
``list_backends()`` says which backend is usable and why not; ``use_backend("eager")`` forces
the fallback; ``prepare_cuda(on_progress)`` builds the extension ahead of the first op,
reporting progress.
Environment: ``CNA_KERNELS=auto|cuda|eager`` (auto: the CUDA kernels once validated on a GPU,
see ``registry.VALIDATED_SOURCES``), ``CNA_FORCE_EAGER=1`` (never build), ``CNA_KERNELS_VERBOSE=1``
(show the compiler), ``CNA_KERNELS_CACHE=DIR`` (build cache), ``CNA_CUDA_ARCH=9.0`` (target
without a GPU).
"""

from __future__ import annotations

from .ops import (
    control_merge,
    control_merge_add_,
    dequant_add_,
    dequant_rows,
    dequant_rows_multi,
    group_norm_silu,
    int8_linear,
    int8_linear_expands,
    quantize_int8,
)
from .registry import (
    NoCapableBackend,
    list_backends,
    mark_unavailable,
    prepare_cuda,
    use_backend,
)

__all__ = [
    "NoCapableBackend",
    "control_merge",
    "control_merge_add_",
    "dequant_add_",
    "dequant_rows",
    "dequant_rows_multi",
    "group_norm_silu",
    "int8_linear",
    "int8_linear_expands",
    "list_backends",
    "mark_unavailable",
    "prepare_cuda",
    "quantize_int8",
    "use_backend",
]
