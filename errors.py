# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's exceptions. A user-facing error names the node, the input and the fix."""

from __future__ import annotations

import torch

# ComfyUI reports an error's type as ``<class __module__>.<class name>`` (execution.py,
# ``full_type_name``). The pack's modules are named after the folder ComfyUI loaded it from (a
# file path), so every pack exception carries this short, stable name instead: the user sees
# ``controlnet_accelerator.NodeInputError`` wherever the pack is installed.
PUBLIC_MODULE = "controlnet_accelerator"


class ControlNetAcceleratorError(RuntimeError):
    """Root of every error the pack raises on purpose. Subclasses, wherever they are defined,
    report the short module name ``PUBLIC_MODULE``."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = PUBLIC_MODULE


ControlNetAcceleratorError.__module__ = PUBLIC_MODULE


class NodeInputError(ControlNetAcceleratorError, ValueError):
    """A node got an input it cannot use; the message says which and what to do."""

    def __init__(self, node: str, input_name: str, problem: str, fix: str):
        self.node, self.input_name, self.problem, self.fix = node, input_name, problem, fix
        super().__init__(f"{node}: input '{input_name}' {problem}. {fix}")


def is_out_of_memory(exc: BaseException) -> bool:
    """True when ``exc``, or an exception it was raised from, is an allocation failure: CUDA's
    ``torch.OutOfMemoryError``, or the CPU allocator's RuntimeError. Wrappers such as the graph
    cache's ``CaptureFailed`` keep the original only in their message, so that is read too."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
            return True
        text = str(e)
        if "OutOfMemoryError" in text or "out of memory" in text or "can't allocate memory" in text:
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False
