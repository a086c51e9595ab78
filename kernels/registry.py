# SPDX-License-Identifier: GPL-3.0-or-later
"""Which backend serves each op, and why the others cannot.

Two backends: ``cuda`` (the pack's JIT-compiled extension) and ``eager`` (plain PyTorch, always
available, also the CPU path). ``mark_unavailable`` records why a backend cannot serve, once;
``use_backend("eager")`` forces one (tests, debugging); ``list_backends()`` is the report for logs
and the front end. What each op accepts (dtypes, devices) is data in ``constraints.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
# hardware (tests/kernels, marker cuda): an unverified kernel must never change a picture. The
# mark is the hash of the kernel sources those tests passed on (``_jit.sources_hash()``): any
# change to a kernel source turns the automatic choice off until the tests pass again and this
# hash is updated (CNA_KERNELS=cuda opts in meanwhile).
# Passed on an NVIDIA H100 (sm_90, torch 2.11 + CUDA 13): every kernel test of the extension
# (``pytest -m cuda tests/kernels``), graph_if's under both allocators included.
VALIDATED_SOURCES = "528324661010408e"
# Ops added after that validation: CUDA only when asked for (CNA_KERNELS=cuda) until theirs pass.
NOT_YET_VALIDATED: set[str] = set()
# Ops served by a Triton kernel outside the extension, each validated against the hash of its
# own source file (``triton_source_hash``), the same way. A kernel that passes but is slower
# than the path it would replace is left out too: ``int8_linear`` passed its GPU tests on an
# H200 and is slower there than expanding the weight for cuBLAS at 18 of 19 SD shapes
# (docs/benchmarks.md, Kernels), so it runs only with CNA_KERNELS=cuda.
TRITON_SOURCES = {"int8_linear": "int8_matmul.py"}
VALIDATED_TRITON: dict[str, str] = {}

_MODES = ("auto", "cuda", "eager")
_mode: str | None = None  # CNA_KERNELS, read once (``refresh_mode`` re-reads it)
_fallbacks_logged: set[tuple[str, str]] = set()  # bounded: one entry per op and limit reason
_UNVALIDATED_NOTE = (
    "the kernel sources differ from those last validated on a GPU; reinstall the pack for the "
    "validated ones, or set CNA_KERNELS=cuda to use these anyway"
)
_unvalidated_logged = False


def mode() -> str:
    """``CNA_KERNELS`` (auto, cuda or eager), read once per process."""
    global _mode
    if _mode is None:
        m = os.environ.get("CNA_KERNELS", "auto").strip().lower() or "auto"
        if m not in _MODES:
            logger.warning(
                "ControlNet Accelerator kernels: CNA_KERNELS=%r is not one of %s; using auto",
                m,
                "/".join(_MODES),
            )
            m = "auto"
        _mode = m
    return _mode


def refresh_mode() -> None:
    """Re-read ``CNA_KERNELS`` (tests; a process changing it after the first op)."""
    global _mode
    _mode = None


def _sources_validated() -> bool:
    from . import _jit

    try:
        return _jit.sources_hash() == VALIDATED_SOURCES
    except OSError:  # sources missing from a broken install: never by default
        return False


def triton_source_hash(op: str) -> str:
    """The hash ``VALIDATED_TRITON`` records for ``op``'s Triton source file."""
    src = Path(__file__).with_name(TRITON_SOURCES[op])
    return hashlib.sha256(src.read_bytes()).hexdigest()[:16]


def _cuda_by_default(op: str | None = None) -> bool:
    m = mode()
    if m == "eager":
        return False
    if m == "cuda":
        return True
    if op in TRITON_SOURCES:
        try:
            return triton_source_hash(op) == VALIDATED_TRITON.get(op)
        except OSError:
            return False
    return _sources_validated() and op not in NOT_YET_VALIDATED


def _note_unvalidated(op: str, tensors: list[torch.Tensor]) -> None:
    """One warning per process when a CUDA op runs on PyTorch only because the kernel sources
    are not the validated ones: a slower step must not go unexplained."""
    global _unvalidated_logged
    if _unvalidated_logged or op in TRITON_SOURCES or op not in _BACKENDS["cuda"].ops:
        return
    if mode() != "auto" or _sources_validated() or not any(t.is_cuda for t in tensors):
        return
    _unvalidated_logged = True
    logger.warning(
        "ControlNet Accelerator kernels: every op of the CUDA extension runs on PyTorch: %s",
        _UNVALIDATED_NOTE,
    )


def note_fallback(op: str, reason: str) -> None:
    """One log line per op and reason when a call falls outside a CUDA kernel's limits."""
    key = (op, reason)
    if key in _fallbacks_logged:
        return
    _fallbacks_logged.add(key)
    logger.info("ControlNet Accelerator kernels: %s runs on PyTorch for this input: %s", op, reason)


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
    if forced:
        order = [forced]
    elif _cuda_by_default(op):
        order = ["cuda", "eager"]
    else:
        order = ["eager"]
        _note_unvalidated(op, tensors)
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


def _cuda_static_reason() -> str | None:
    """Why the CUDA backend cannot serve on this machine, known without building it."""
    from . import _jit

    if mode() == "eager":
        return "switched off (CNA_KERNELS=eager)"
    if os.environ.get("CNA_FORCE_EAGER") == "1":
        return "switched off (CNA_FORCE_EAGER=1)"
    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible"
    if _jit.cuda_home() is None:
        return "no CUDA compiler (nvcc not on PATH, CUDA_HOME unset)"
    return None


def prepare_cuda(on_progress: Callable[[int, int], None] | None = None) -> bool:
    """Build (or load) the CUDA extension now, where the ops would run on it by default (a CUDA
    GPU, a compiler, the kernels validated or ``CNA_KERNELS=cuda``), so that a first build
    happens where the caller can show its progress rather than inside the first op.
    ``on_progress(done, total)``: see ``_jit.build``. Returns whether the extension is loaded;
    never raises (a failed build marks the backend unavailable, as on first use)."""
    from . import _jit

    if _jit.is_loaded():
        return True
    if _BACKENDS["cuda"].unavailable is not None or _cuda_static_reason() is not None:
        return False
    if not _cuda_by_default():
        return False
    return _jit.ensure_loaded(on_progress=on_progress) is not None


def list_backends() -> list[dict]:
    """Each backend: whether it can serve on this machine (``available``) and why not
    (``reason``: switched off, no CUDA in this PyTorch, no GPU, no compiler, or the build's
    error once a build failed), whether it is loaded, whether the ops use it by default, and why
    not (``note``), and its ops. The CUDA extension builds on the first CUDA op, so ``loaded``
    stays False until then."""
    from . import _jit

    out = []
    for b in _BACKENDS.values():
        loaded = True if b.name == "eager" else _jit.is_loaded()
        reason = b.unavailable
        if b.name == "cuda" and reason is None and not loaded:
            reason = _cuda_static_reason()
        entry = {
            "name": b.name,
            "available": reason is None,
            "loaded": loaded,
            "reason": reason,
            "ops": sorted(b.ops),
        }
        if b.name == "cuda":
            by_default = reason is None and _cuda_by_default()
            entry["used_by_default"] = by_default
            if reason is None and not by_default:
                entry["note"] = (
                    _UNVALIDATED_NOTE if mode() == "auto" else f"not used (CNA_KERNELS={mode()})"
                )
        out.append(entry)
    return out
