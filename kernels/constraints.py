# SPDX-License-Identifier: GPL-3.0-or-later
"""What each op accepts on each backend, as data (dtypes and devices); shape rules live in the
ops' own checks. ``dtypes: None`` means any floating dtype the eager math supports."""

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
}
