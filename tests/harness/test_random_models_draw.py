# SPDX-License-Identifier: GPL-3.0-or-later
"""Deterministic tensor drawing, without ComfyUI."""

from __future__ import annotations

import torch
from comfyui_controlnet_accelerator.harness import random_models as rm


def test_draw_is_deterministic_per_key_and_seed():
    a = rm.draw_tensor("input_blocks.1.0.in_layers.2.weight", (8, 4, 3, 3), "Conv2d", 5, "unet")
    b = rm.draw_tensor("input_blocks.1.0.in_layers.2.weight", (8, 4, 3, 3), "Conv2d", 5, "unet")
    c = rm.draw_tensor("input_blocks.1.0.in_layers.2.weight", (8, 4, 3, 3), "Conv2d", 6, "unet")
    d = rm.draw_tensor("input_blocks.2.0.in_layers.2.weight", (8, 4, 3, 3), "Conv2d", 5, "unet")
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, d)


def test_init_scales():
    w = rm.draw_tensor("x.weight", (512, 256), "Linear", 1, "unet")
    assert abs(w.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    n = rm.draw_tensor("norm.weight", (4096,), "GroupNorm", 1, "unet")
    assert abs(n.mean().item() - 1.0) < 0.01
    zc = rm.draw_tensor("zero_convs.3.0.weight", (640, 640, 1, 1), "Conv2d", 1, "controlnet")
    # A trained ControlNet starts from zero convolutions; the drawn ones must not be zero, or
    # the control residuals (and every test of them) would vanish: no weight and no output
    # channel is zero, and every channel has about the intended scale.
    want = rm.CONTROL_GAIN * 640**-0.5
    assert torch.count_nonzero(zc) == zc.numel()
    per_channel = zc.flatten(1).std(dim=1)
    assert per_channel.min().item() > 0.5 * want, per_channel.min()
    assert abs(zc.std().item() - want) < 0.05 * 640**-0.5
    mid = rm.draw_tensor("middle_block_out.0.weight", (640, 640, 1, 1), "Conv2d", 1, "controlnet")
    assert abs(mid.std().item() - want) < 0.05 * 640**-0.5


def test_specs_pair_controlnets_with_their_checkpoints():
    for _name, spec in rm.SPECS.items():
        if spec.kind == "controlnet":
            assert spec.arch in rm.ARCH_UNETS
            assert any(s.kind == "checkpoint" and s.arch == spec.arch for s in rm.SPECS.values())
    assert len({s.seed for s in rm.SPECS.values()}) == len(rm.SPECS)
