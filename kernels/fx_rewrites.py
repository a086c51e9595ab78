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

Off unless ``CNA_COMPILE_GROUP_NORM=1``: in a whole step it has not beaten inductor's code. At
SDXL 1024² with one ControlNet, where the GroupNorms are the sizes the kernel is 1.6–2.5× faster
at alone, compiled mode measured 0.3 ms/step slower with it (docs/benchmarks.md, *GroupNorm on
the pack's channels-last kernel*).

Plain PyTorch; no ComfyUI import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import constraints, ops, registry

ENV = "CNA_COMPILE_GROUP_NORM"
_GROUP_NORMS = (F.group_norm, torch.group_norm)
_SILUS = (F.silu, torch.nn.functional.silu, torch.ops.aten.silu.default)


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
    """Whether the kernel beats inductor's own GroupNorm(+SiLU) at this (B, C, H, W), from the
    kernel microbenchmark on an H200 (fp16, batch 2; docs/benchmarks.md, *GroupNorm on
    channels-last activations*): at least 1.2× faster at 32×32 and larger with 640 channels or
    more, and at 320×128×128; slower at 320×64×64 (inductor's best case) and even at 16×16 and
    below, where each of the kernel's three launches costs more than the data."""
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
