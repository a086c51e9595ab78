# SPDX-License-Identifier: GPL-3.0-or-later
"""The stock ControlNet workflow runs end to end through ComfyUI's executor on the tiny models."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf

pytestmark = pytest.mark.host


def _run(wl, seed, r=None):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints)
    return (r or runner.Runner()).run(p, ids)


def test_stock_controlnet_workflow_runs_and_decodes(tiny_models):
    wl = wf.WORKLOADS["T1"].with_(decode=True)
    res = _run(wl, seed=11)
    assert res.latent.shape == (1, 4, wl.height // 8, wl.width // 8)
    assert torch.isfinite(res.latent).all()
    assert res.image.shape == (1, wl.height, wl.width, 3)
    assert torch.isfinite(res.image).all() and 0.0 <= res.image.min() and res.image.max() <= 1.0
    assert len(res.step_ms) == wl.steps - 1  # the progress hook fired once per step


def test_same_seed_is_bit_identical_in_fresh_executors(tiny_models):
    wl = wf.WORKLOADS["T2"]
    a = _run(wl, seed=5)
    b = _run(wl, seed=5)
    assert torch.equal(a.latent, b.latent)
    assert runner.psnr(a.latent, b.latent) == float("inf")


def test_controlnet_changes_the_result(tiny_models):
    """Residuals are real: with the ControlNet the latent differs from the one without it,
    and strength 0 (which the apply node turns into a pass-through) gives the plain result."""
    r = runner.Runner()
    plain = _run(wf.WORKLOADS["T0"], 3, r)
    with_cn = _run(wf.WORKLOADS["T1"], 3, r)
    off = _run(wf.WORKLOADS["T1"].with_(strength=0.0), 3, r)
    assert not torch.allclose(plain.latent, with_cn.latent, rtol=0, atol=1e-3)
    assert torch.equal(plain.latent, off.latent)
    assert runner.psnr(plain.latent, with_cn.latent) < 60


def test_two_controlnets_differ_from_one(tiny_models):
    r = runner.Runner()
    one = _run(wf.WORKLOADS["T1"], 4, r)
    two = _run(wf.WORKLOADS["T2"], 4, r)
    assert not torch.allclose(one.latent, two.latent, rtol=0, atol=1e-3)


def test_broken_workflow_raises_with_node_and_reason(tiny_models):
    wl = wf.WORKLOADS["T1"]
    p, ids = wf.build_prompt(wl, 1, ["does_not_exist.png"])
    with pytest.raises(runner.WorkflowFailed, match="validate|LoadImage|does_not_exist"):
        runner.Runner().run(p, ids)
