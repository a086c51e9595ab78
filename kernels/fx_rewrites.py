# SPDX-License-Identifier: GPL-3.0-or-later
"""Rewrites of a traced graph (the FX graph torch.compile hands its backend) that put the pack's
kernels where inductor's own code is slower.

``GroupNormRewrite``: every ``F.group_norm`` on a channels-last 4-D activation, with the SiLU
that follows it when there is one, becomes one call of ``cna::group_norm_nhwc``, whose kernel
reads whole pixel rows of the channels-last layout compiled mode keeps
(``csrc/ops/group_norm_nhwc.cu``). It applies where the CUDA kernel serves (its GPU tests
passed for these sources, or ``CNA_KERNELS=cuda``) and where it measured faster than inductor's
own code for the same GroupNorm (``pays``), unless built with ``force=True`` (the tests, which
run the op's PyTorch path on the CPU). A GroupNorm the kernel cannot take (another layout,
affine parameters in another dtype, too many channels) is left to inductor.

Off unless ``CNA_COMPILE_GROUP_NORM=1``: it has not beaten inductor's code. At SDXL 1024² with
one ControlNet compiled mode measured 0.3 ms/step slower with it, and alone the kernel is slower
than inductor's code compiled with static shapes, as compiled mode compiles it, at the sizes
``pays`` takes (docs/benchmarks.md, *GroupNorm on channels-last activations*).

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

from . import constraints, geglu_linear, ops, registry

ENV = "CNA_COMPILE_GROUP_NORM"
GEGLU_ENV = "CNA_COMPILE_GEGLU"
_GROUP_NORMS = (F.group_norm, torch.group_norm)
_SILUS = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)
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


def enabled() -> bool:
    """``CNA_COMPILE_GROUP_NORM=1`` turns the rewrite on; otherwise every GroupNorm is
    inductor's. Read at each compile; compiled mode also leaves the rewrite out of its settings
    when it is off, so that code compiled with and without it is kept apart (the benchmark
    compares the two in one process)."""
    return os.environ.get(ENV, "0").strip() == "1"


def pays(shape) -> bool:
    """The (B, C, H, W) the opt-in rewrite takes: 32×32 and larger with 640 channels or more,
    and 320×128×128, where a kernel microbenchmark whose inductor code was compiled with dynamic
    shapes had the kernel at least 1.2× faster. Against static code, as compiled mode compiles,
    it is slower at these sizes too (docs/benchmarks.md, *GroupNorm on channels-last
    activations*); the rewrite is off by default."""
    _, c, h, w = shape
    return h * w >= 1024 and (c >= 640 or c * h * w >= 4 * 2**20)


@dataclass(frozen=True)
class GroupNormRewrite:
    """A graph pass: ``rewrite(gm)`` edits ``gm`` in place and returns how many GroupNorms it
    replaced (and of those, how many took their SiLU along)."""

    force: bool = False

    def __call__(self, gm: torch.fx.GraphModule) -> str | None:
        done, fused = self.rewrite(gm)
        if not done:
            return None
        return (
            f"{done} GroupNorm{'s' if done != 1 else ''} ({fused} with SiLU) on the pack's kernel"
        )

    def _takes(self, x, w, b, groups) -> bool:
        if not all(isinstance(t, torch.Tensor) for t in (x, w, b)) or not isinstance(groups, int):
            return False
        if x.dim() != 4 or groups <= 0 or x.shape[1] % groups:
            return False
        if not x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous():
            return False  # plain NCHW (or a 1×1 image, both at once): not this kernel's layout
        if w.dtype != x.dtype or b.dtype != x.dtype or w.device != x.device:
            return False
        if w.dim() != 1 or w.shape[0] != x.shape[1] or b.shape != w.shape:
            return False
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, w, b)):
            return False  # the op has no backward; inference only
        c, v = x.shape[1], 16 // x.element_size()
        lim = constraints.CUDA_LIMITS["group_norm_nhwc"]
        if (c // v if c % v == 0 else c) > lim["max_channel_vectors"]:
            return False
        if self.force:
            return True
        if x.device.type != "cuda" or not pays(x.shape) or not enabled():
            return False
        try:
            return registry.select("group_norm_nhwc", [x]) == "cuda"
        except registry.NoCapableBackend:
            return False

    def rewrite(self, gm: torch.fx.GraphModule) -> tuple[int, int]:
        ops.group_norm_nhwc  # noqa: B018 (the custom op is registered on import)
        target = torch.ops.cna.group_norm_nhwc.default
        graph = gm.graph
        done = fused = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _GROUP_NORMS:
                continue
            x, groups = _arg(node, 0, "input"), _arg(node, 1, "num_groups")
            w, b, eps = _arg(node, 2, "weight"), _arg(node, 3, "bias"), _arg(node, 4, "eps", 1e-5)
            if not self._takes(_value(x), _value(w), _value(b), groups):
                continue
            users = list(node.users)
            silu = (
                len(users) == 1
                and users[0].op == "call_function"
                and users[0].target in _SILUS
                and not users[0].kwargs.get("inplace", False)
                and len(users[0].args) == 1
            )
            last = users[0] if silu else node
            with graph.inserting_after(last):
                new = graph.call_function(target, (x, w, b, groups, float(eps), silu))
            val = _value(last)
            if isinstance(val, torch.Tensor):
                new.meta["example_value"] = torch.empty_like(val, memory_format=torch.channels_last)
            last.replace_all_uses_with(new)
            if silu:
                graph.erase_node(last)
            graph.erase_node(node)
            done += 1
            fused += int(silu)
        if done:
            graph.lint()
            gm.recompile()
        return done, fused


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
