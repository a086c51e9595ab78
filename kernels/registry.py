# SPDX-License-Identifier: GPL-3.0-or-later
"""Which backend serves each op, and why the others cannot.

Two backends: ``cuda`` (the pack's JIT-compiled extension) and ``eager`` (plain PyTorch, always
available, also the CPU path). ``mark_unavailable`` records why a backend cannot serve, once;
``use_backend("eager")`` forces one (tests, debugging); ``list_backends()`` is the report for logs
and the front end. What each op accepts (dtypes, devices) is data in ``constraints.py``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field

import torch

from ..logger import logger
from .constraints import CONSTRAINTS


class NoCapableBackend(RuntimeError):
    """No backend can run this op on these inputs; the message lists each and why."""


@dataclass
class Backend:
    name: str
    ops: set[str] = field(default_factory=set)
    unavailable: str | None = None  # reason, once known


_BACKENDS: dict[str, Backend] = {"cuda": Backend("cuda"), "eager": Backend("eager")}
_forced = threading.local()

# The CUDA kernels are chosen automatically only once their GPU tests have passed on real
# hardware (tests/kernels, marker cuda): an unverified kernel must never change a picture.
# Passed on an NVIDIA H200 (sm_90, torch 2.11 + CUDA 13), 2026-11-30: all 116 kernel tests.
# Set this back to False (CNA_KERNELS=cuda then opts in) whenever a kernel changes untested.
VALIDATED_ON_GPU = True
# Ops added since that run: CUDA only when asked for (CNA_KERNELS=cuda) until theirs pass too.
# (dequant_rows: its 15 CUDA cases passed on the H200, 2026-11-30, second session of the day;
# its faster vector path of session 7 passed them again there, with dequant_add's: 37 of 37.)
NOT_YET_VALIDATED: set[str] = set()


def _cuda_by_default(op: str | None = None) -> bool:
    mode = os.environ.get("CNA_KERNELS", "auto")
    if mode == "eager":
        return False
    if mode == "cuda":
        return True
    return VALIDATED_ON_GPU and op not in NOT_YET_VALIDATED


def register(backend: str, op: str) -> None:
    _BACKENDS[backend].ops.add(op)


def mark_unavailable(backend: str, reason: str) -> None:
    b = _BACKENDS[backend]
    if b.unavailable is None:
        b.unavailable = reason
        logger.warning(
            "ControlNet Accelerator kernels: %s backend unavailable, using eager PyTorch: %s",
            backend,
            reason,
        )


def reset_unavailable(backend: str) -> None:
    """Forget a recorded failure (tests; or after the user installed a compiler)."""
    _BACKENDS[backend].unavailable = None


@contextlib.contextmanager
def use_backend(name: str):
    """Force every op in this thread onto one backend (``cuda`` raises if it cannot serve)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose from {sorted(_BACKENDS)}")
    prev = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = prev


def _why_not(backend: str, op: str, tensors: list[torch.Tensor]) -> str | None:
    b = _BACKENDS[backend]
    if op not in b.ops:
        return "does not implement this op"
    if b.unavailable is not None:
        return b.unavailable
    c = CONSTRAINTS[op].get(backend)
    if c is None:
        return None
    for t in tensors:
        if t.device.type not in c["devices"]:
            return f"tensor on {t.device.type}, needs {'/'.join(c['devices'])}"
        if c.get("dtypes") is not None and t.dtype not in c["dtypes"]:
            return f"dtype {t.dtype} not in {[str(d) for d in c['dtypes']]}"
    return None


def select(op: str, tensors: list[torch.Tensor]) -> str:
    """The backend to run ``op`` on these tensors: forced, else cuda if it can, else eager."""
    forced = getattr(_forced, "name", None)
    order = [forced] if forced else (["cuda", "eager"] if _cuda_by_default(op) else ["eager"])
    reasons = []
    for name in order:
        if name == "cuda" and _BACKENDS["cuda"].unavailable is None and op in _BACKENDS["cuda"].ops:
            from . import _jit

            if any(t.is_cuda for t in tensors):
                _jit.ensure_loaded()  # builds on first use; failure marks cuda unavailable
        why = _why_not(name, op, tensors)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise NoCapableBackend(f"no backend can run {op}: " + "; ".join(reasons))


def list_backends() -> list[dict]:
    """Each backend, whether it is usable, why not, whether it is loaded, and its ops.

    The cuda backend reads ``available`` until a first CUDA op tries to build it (``loaded``
    False); after a failed build it is unavailable with the reason.
    """
    from . import _jit

    out = []
    for b in _BACKENDS.values():
        loaded = True if b.name == "eager" else _jit.is_loaded()
        entry = {
            "name": b.name,
            "available": b.unavailable is None,
            "loaded": loaded,
            "reason": b.unavailable,
            "ops": sorted(b.ops),
        }
        if b.name == "cuda":
            entry["used_by_default"] = _cuda_by_default()
            if not _cuda_by_default() and b.unavailable is None:
                entry["note"] = (
                    "not used by default until validated on a GPU; set CNA_KERNELS=cuda to use it"
                )
        out.append(entry)
    return out
