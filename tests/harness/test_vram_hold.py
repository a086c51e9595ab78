# SPDX-License-Identifier: GPL-3.0-or-later
"""``benchmark.py --free-vram``: the size the helper process holds, and its start-up protocol."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.harness import quick, vram_hold

GiB = vram_hold.GiB
MiB = vram_hold.MiB


def test_the_helper_holds_what_is_free_beyond_the_target_and_the_benchmarks_context():
    got = vram_hold.ballast_bytes(70 * GiB, 16 * GiB)
    assert got == 54 * GiB - vram_hold.CONTEXT_MIB * MiB


@pytest.mark.parametrize("want", [0, -1, 69.8, 70, 80])
def test_a_target_that_cannot_be_left_free_is_refused_with_the_free_memory(want):
    with pytest.raises(ValueError, match="--free-vram") as e:
        vram_hold.ballast_bytes(70 * GiB, int(want * GiB))
    if want > 0:
        assert "70.0 GiB of the GPU is free" in str(e.value)


def test_the_helper_holds_its_memory_until_the_context_closes():
    hold = vram_hold.Hold(1 / 1024, device="cpu", assume_free=vram_hold.CONTEXT_MIB * MiB + 9 * MiB)
    with hold as h:
        proc = h._proc
        assert h.held_mib == 8  # 9 MiB free less the 1 MiB asked for, in whole MiB
        assert proc.poll() is None  # still holding
    assert proc.returncode == 0 and h._proc is None


def test_a_helper_that_cannot_leave_the_target_free_says_so():
    with pytest.raises(ValueError, match="only 1.0 GiB of the GPU is free"):
        with vram_hold.Hold(4, device="cpu", assume_free=GiB):
            pass


def test_the_option_parses_as_gib():
    assert quick.build_parser().parse_args(["--free-vram", "15.5"]).free_vram == 15.5
    assert quick.build_parser().parse_args([]).free_vram is None


@pytest.mark.cuda
def test_cuda_hold_leaves_about_the_target_free_and_gives_it_back():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.cuda.init()
    before, _ = torch.cuda.mem_get_info()
    ours = torch.cuda.memory_allocated()
    target = max(1.0, before / GiB / 2)
    with vram_hold.Hold(target, device=f"cuda:{torch.cuda.current_device()}") as h:
        free, _ = torch.cuda.mem_get_info()
        # this process's context already exists, so about CONTEXT_MIB more than asked is free
        assert abs(free / GiB - target) < 1.5, (free / GiB, target)
        assert h.held_mib > 0
        assert torch.cuda.memory_allocated() == ours  # not this process's allocation
    after, _ = torch.cuda.mem_get_info()
    assert after > free + GiB  # the helper gave it back
