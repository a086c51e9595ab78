# SPDX-License-Identifier: GPL-3.0-or-later
"""A rewrite of a traced graph (the FX graph torch.compile hands its backend) that runs one of
the pack's kernels in place of inductor's own code.

``GegluRewrite``: a feed-forward projection followed by its GEGLU (``F.linear`` → ``chunk(2,
-1)`` → ``value * F.gelu(gate)``, as ComfyUI's ``GEGLU`` writes it) becomes one call of
``cna::geglu_linear``, a matrix multiply that applies the GEGLU before storing
(``geglu_linear.py``), so the projection's full-width result is never written. Off unless
``CNA_COMPILE_GEGLU=1``: alone, the kernel is faster than inductor's GEMM + GEGLU at the UNet's
first level and slower at the deeper ones, where its matrix multiply's lower speed than cuBLAS's
costs more than the GEGLU's pass it saves; a whole compiled step at SDXL 1024² with one
ControlNet ran 0.7 ms/step slower with it (docs/benchmarks.md, *GEGLU in the feed-forward
projection*).

Plain PyTorch; no ComfyUI import.
"""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import geglu_linear, ops

GEGLU_ENV = "CNA_COMPILE_GEGLU"
_LINEARS = (F.linear, torch._C._nn.linear)
_GELUS = (F.gelu, torch._C._nn.gelu)
_MULS = (operator.mul, torch.mul)


def _value(node):
    if isinstance(node, torch.fx.Node):
        return node.meta.get("example_value")
    return None


def _arg(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def geglu_enabled() -> bool:
    """``CNA_COMPILE_GEGLU=1`` turns the GEGLU rewrite on; otherwise every GEGLU is inductor's.
    Read at each compile (compiled mode also leaves the rewrite out of its settings when it is
    off, so code compiled with and without it is kept apart)."""
    return os.environ.get(GEGLU_ENV, "0").strip() == "1"


def _only_user(node: torch.fx.Node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_call(node, targets) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def geglu_pays(tokens: int) -> bool:
    """Whether the kernel beats inductor's GEMM + GEGLU for a projection of this many tokens
    (batch included), from the kernel microbenchmark on an H100 against inductor's static code
    (docs/benchmarks.md, *GEGLU in the feed-forward projection*): 1.07–1.28× faster at 8,192
    tokens and more (the UNet's first level: SD1.5 512² and SDXL 1024² at batch 2), 0.84–1.01×
    at 2,048 and fewer, where cuBLAS's faster matrix multiply outweighs the GEGLU's pass."""
    return tokens >= 8192


@dataclass(frozen=True)
class GegluRewrite:
    """A graph pass: each ``F.linear`` whose only use is ComfyUI's GEGLU (``chunk(2, dim=-1)``,
    then ``value * F.gelu(gate)``, exact GELU) becomes one ``cna::geglu_linear`` call. Applies
    where the kernel can run (CUDA, Triton, half-precision, the weight's rows contiguous) and
    measured faster (``geglu_pays``), or everywhere with ``force=True`` (the tests: the op's
    PyTorch path on the CPU)."""

    force: bool = False

    def __call__(self, gm: torch.fx.GraphModule) -> str | None:
        done = self.rewrite(gm)
        if not done:
            return None
        return f"{done} GEGLU{'s' if done != 1 else ''} in their projection's matrix multiply"

    def _takes(self, x, w, b) -> bool:
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            return False
        if b is not None and not isinstance(b, torch.Tensor):
            return False
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, w, b)
        ):  # the op has no backward; inference only
            return False
        if w.dim() != 2 or w.shape[0] % 2 or x.shape[-1] != w.shape[1]:
            return False
        if self.force:
            return True
        if not geglu_enabled() or geglu_linear.triton_missing() is not None:
            return False
        return geglu_linear.problem(x, w, b) is None and geglu_pays(x.numel() // x.shape[-1])

    @staticmethod
    def _pattern(node: torch.fx.Node):
        """(linear, mul) of a GEGLU starting at ``node``, or None."""
        if not _is_call(node, _LINEARS):
            return None
        chunk = _only_user(node)
        if chunk is None or chunk.op != "call_method" or chunk.target != "chunk":
            return None
        chunks = chunk.args[1] if len(chunk.args) > 1 else chunk.kwargs.get("chunks")
        dim = chunk.args[2] if len(chunk.args) > 2 else chunk.kwargs.get("dim", 0)
        out = _value(node)
        if chunks != 2 or not isinstance(out, torch.Tensor) or dim not in (-1, out.dim() - 1):
            return None
        parts = {}
        for user in chunk.users:
            if not _is_call(user, (operator.getitem,)) or user.args[1] not in (0, 1):
                return None
            parts[user.args[1]] = user
        if set(parts) != {0, 1}:
            return None
        value, gate = parts[0], parts[1]
        gelu = _only_user(gate)
        if not _is_call(gelu, _GELUS) or len(gelu.args) != 1:
            return None
        if gelu.kwargs.get("approximate", "none") != "none":
            return None
        mul = _only_user(gelu)
        if not _is_call(mul, _MULS) or _only_user(value) is not mul or mul.kwargs:
            return None
        if set(mul.args) != {value, gelu} or len(mul.args) != 2:
            return None
        return node, mul

    def rewrite(self, gm: torch.fx.GraphModule) -> int:
        ops.geglu_linear  # noqa: B018 (the custom op is registered on import)
        target = torch.ops.cna.geglu_linear.default
        graph = gm.graph
        done = 0
        for node in list(graph.nodes):
            found = self._pattern(node)
            if found is None:
                continue
            linear, mul = found
            x, w = _arg(linear, 0, "input"), _arg(linear, 1, "weight")
            b = _arg(linear, 2, "bias")
            if not self._takes(_value(x), _value(w), _value(b) if b is not None else None):
                continue
            with graph.inserting_after(mul):
                new = graph.call_function(target, (x, w, b))
            val = _value(mul)
            if isinstance(val, torch.Tensor):
                new.meta["example_value"] = torch.empty_like(val)
            mul.replace_all_uses_with(new)
            # the pattern's nodes, from its end back to the projection
            gelu = next(a for a in mul.args if _is_call(a, _GELUS))
            value = next(a for a in mul.args if a is not gelu)
            gate, chunk = gelu.args[0], value.args[0]
            for n in (mul, gelu, gate, value, chunk, linear):
                graph.erase_node(n)
            done += 1
        if done:
            graph.lint()
            gm.recompile()
        return done
