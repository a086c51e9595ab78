# SPDX-License-Identifier: GPL-3.0-or-later
"""Channels-last weights during sampling (the CUDA Graph node's experimental option).

The convolutions may pick another algorithm for the other layout. On the CPU (fp32) we require
relative L2 ≤ 1e-5 against the same graph without it; on a GPU (fp16, where cuDNN's NHWC
kernels round differently) the latent PSNR must be ≥ 45 dB, the fp16 bound of the other parity
tests (the H200 gave 0.24% relative L2 there, about 52 dB). The weights must come back with the
same values, layout and storage after every run, interrupted runs included.
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS

pytestmark = pytest.mark.host

WL = wf.WORKLOADS["T2"].with_(steps=6)


@pytest.fixture(autouse=True)
def cpu_layout(host, monkeypatch):
    if host.cpu:
        monkeypatch.setenv("CNA_GRAPH_BACKEND", "emulate")
        cl = sys.modules[host.pack_module_name].nodes.channels_last
        monkeypatch.setattr(cl, "DEVICES", ("cuda", "cpu"))


def _run(r, wl, seed, extra=None, on_step=None):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints, extra)
    return r.run(p, ids, on_step=on_step)


def _conv_weights():
    """Every Conv2d weight of every loaded model: (tensor, address, checksum, contiguous)."""
    import comfy.model_management

    out = []
    for lm in comfy.model_management.current_loaded_models:
        model = lm.model.model if lm.model is not None else None
        if model is None:
            continue
        for m in model.modules():
            if isinstance(m, torch.nn.Conv2d):
                w = m.weight
                out.append((w, w.data_ptr(), float(w.detach().double().sum()), w.is_contiguous()))
    return out


def test_relayout_keeps_values_and_storage():
    from comfyui_controlnet_accelerator.nodes.channels_last import relayout_

    w = torch.randn(8, 3, 3, 3)
    ref, ptr = w.clone(), w.data_ptr()
    assert relayout_(w, torch.channels_last)
    assert w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
    assert w.data_ptr() == ptr and torch.equal(w, ref)
    assert not relayout_(w, torch.channels_last)  # already there
    assert relayout_(w, torch.contiguous_format)
    assert w.is_contiguous() and w.data_ptr() == ptr and torch.equal(w, ref)
    assert not relayout_(w[:, :2], torch.channels_last)  # a view: left alone


@pytest.mark.captures  # the option acts inside the graphs, which DynamicVRAM turns off
def test_channels_last_matches_and_puts_the_weights_back(host, tiny_models):
    r = runner.Runner()
    plain = _run(r, WL, 21, VARIANTS["cuda_graph"])
    before = _conv_weights()
    assert before and all(c for *_, c in before)
    cl = _run(r, WL, 21, VARIANTS["cuda_graph_cl"])
    if host.cpu:
        rel = (cl.latent.double() - plain.latent.double()).norm() / plain.latent.double().norm()
        assert rel.item() <= 1e-5, rel.item()
    else:
        assert runner.psnr(plain.latent, cl.latent) >= 45.0
    after = {id(w): (p, s, c) for w, p, s, c in _conv_weights()}
    assert all(id(w) in after for w, *_ in before)  # still loaded: each one is checked
    for w, p, s, c in before:
        assert after[id(w)] == (p, s, c)  # same storage, same values, NCHW again


@pytest.mark.captures  # the option acts inside the graphs, which DynamicVRAM turns off
def test_interrupted_run_still_puts_the_weights_back(host, tiny_models):
    import comfy.model_management

    r = runner.Runner()
    _run(r, WL, 22)
    before = _conv_weights()
    layouts = []

    def interrupt(step):
        layouts.append(
            any(
                w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                for w, *_ in _conv_weights()
            )
        )
        if step == 2:
            comfy.model_management.interrupt_current_processing(True)

    with pytest.raises(runner.WorkflowFailed, match="interrupted"):
        _run(r, WL, 23, VARIANTS["cuda_graph_cl"], on_step=interrupt)
    assert len(layouts) == 2  # stopped inside sampling, at step 2
    assert any(layouts), "the weights were never channels-last during the run"
    after = {id(w): (p, s, c) for w, p, s, c in _conv_weights()}
    assert all(id(w) in after for w, *_ in before)  # still loaded: each one is checked
    for w, p, s, c in before:
        assert after[id(w)] == (p, s, c)


@pytest.mark.captures  # the option acts inside the graphs, which DynamicVRAM turns off
def test_weights_comfyui_moves_are_left_in_its_layout(host, tiny_models, monkeypatch):
    """A ControlNet under DynamicVRAM (or lowvram) keeps ComfyUI's layout for the whole run:
    ComfyUI may refill those weights from its own copy as the run goes on. Here its network is
    made to look DynamicVRAM-managed; the UNet's weights still go channels-last."""
    compat = sys.modules[host.pack_module_name].nodes.compat
    real = compat.dynamic_layers
    monkeypatch.setattr(
        compat,
        "dynamic_layers",
        lambda m: 7 if type(m).__name__ == "ControlNet" else real(m),
    )
    import comfy.model_management

    def layouts():
        out = {}
        for lm in comfy.model_management.current_loaded_models:
            model = lm.model.model if lm.model is not None else None
            if model is None:
                continue
            convs = [
                m.weight
                for m in model.modules()
                if isinstance(m, torch.nn.Conv2d) and m.weight.shape[-2:] != (1, 1)
            ]
            cl = [w.is_contiguous(memory_format=torch.channels_last) for w in convs]
            if type(model).__name__ == "ControlNet":
                out.setdefault("ControlNet", []).extend(cl)
            elif hasattr(model, "diffusion_model"):
                out.setdefault("UNet", []).extend(cl)
        return out

    seen = []
    r = runner.Runner()
    _run(r, WL, 25, VARIANTS["cuda_graph_cl"], on_step=lambda step: seen.append(layouts()))
    assert seen
    for got in seen:
        assert got["ControlNet"] and not any(got["ControlNet"]), got  # left alone
        assert got["UNet"] and all(got["UNet"]), got  # the model's own did go channels-last
