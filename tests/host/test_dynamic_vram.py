# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA Graph under ComfyUI's DynamicVRAM (0.33+, on by default on NVIDIA GPUs; the harness turns
it on as ComfyUI's main.py does, ``CNA_DYNAMIC_VRAM=0`` turns it off).

DynamicVRAM faults each layer's weights in as the layer runs and may evict them between layers;
a replayed graph skips that code, so the CUDA Graph node hands such a model on unchanged and
says why. These tests need a GPU with DynamicVRAM on (elsewhere the loader is ComfyUI's classic
one, which the other host tests cover). Tolerance: bit-identical to stock, since the steps run
stock's code on stock's model.
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]


@pytest.fixture
def dynamic(host):
    if not host.dynamic_vram:
        pytest.skip("DynamicVRAM is not on in this ComfyUI (0.33+ on a GPU only)")
    return host


def _run(r, wl, seed, extra=None):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints, extra)
    return r.run(p, ids), p


def test_dynamic_vram_models_pass_through_with_the_reason_and_match_stock(dynamic, tiny_models):
    pack = sys.modules[dynamic.pack_module_name]
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=6)
    # The run that loads the models under DynamicVRAM can differ from later runs of the same
    # prompt in the last bits (seen on the H200): compare warm runs, as of a user's second prompt.
    _run(r, wl, 3)
    stock, _ = _run(r, wl, 4)
    got, p = _run(r, wl, 4, VARIANTS["cuda_graph"])
    assert torch.equal(stock.latent, got.latent)
    node = next(k for k, v in p.items() if v["class_type"] == "CNA_CUDAGraph")
    data = pack.nodes.status.LAST[node]["data"]
    assert data == {"passed_through": pack.nodes.compat.DYNAMIC_PASS_THROUGH}, data
