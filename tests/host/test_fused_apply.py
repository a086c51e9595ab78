# SPDX-License-Identifier: GPL-3.0-or-later
"""Apply ControlNet (Fused) against stock Apply ControlNet, same random weights and seeds.

Tolerance: on the CPU everything runs in fp32 and the fused merge adds the same fp32 products
in the same order as stock, so we require relative L2 error ≤ 1e-5 on the final latent (the
issue's bound; in practice it is exact). On a GPU (``CNA_TEST_GPU=1``, fp16) the fused merge
rounds once where stock rounds after each scale and add, so we require PSNR ≥ 45 dB.
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import badges, runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _chain

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

FUSED = VARIANTS["fused"]
THREE = wf.WORKLOADS["T2"].with_(controlnets=("sd15-tiny-cn-a", "sd15-tiny-cn-b", "sd15-tiny-cn-a"))


def _fa(host):
    return sys.modules[host.pack_module_name].nodes.fused_apply


def _run(r, wl, seed, extra=None):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints, extra)
    return badges.run(r, p, ids)  # with the nodes' badges: the run's own figures


def _fused_figures(res) -> dict:
    return badges.summed(res, "fused_apply", ("hint_encodes", "fused_merges", "positive_only"))


def _close(host, stock, got):
    if host.cpu:
        rel = (
            (got.latent.double() - stock.latent.double()).norm() / stock.latent.double().norm()
        ).item()
        assert rel <= 1e-5, rel
    else:
        assert runner.psnr(stock.latent, got.latent) >= 45.0


CASES = {
    "1cn": wf.WORKLOADS["T1"],
    "2cn": wf.WORKLOADS["T2"],
    "3cn": THREE,
    "2cn-range-strength": wf.WORKLOADS["T2"].with_(
        start_percent=0.2, end_percent=0.75, strength=0.65
    ),
    "1cn-strong": wf.WORKLOADS["T1"].with_(strength=2.5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fused_matches_stock(host, tiny_models, case):
    wl = CASES[case].with_(steps=10)
    r = runner.Runner()
    stock = _run(r, wl, 31)
    fused = _run(r, wl, 31, FUSED)
    _close(host, stock, fused)
    st = _fused_figures(fused)
    # the hint encoder ran once per ControlNet for the whole run, not once per step
    assert st["hint_encodes"] == len(wl.controlnets), st
    # one fused merge per step (cond and uncond in one batch; the range may skip some)
    assert 1 <= st["fused_merges"] <= wl.steps and st["positive_only"] == 0, st


@pytest.mark.captures  # under DynamicVRAM the graph node hands the model on: nothing to test
def test_fused_with_cuda_graph_matches_stock(host, tiny_models):
    r = runner.Runner()
    for wl in (
        wf.WORKLOADS["T2"].with_(steps=8),
        wf.WORKLOADS["T2"].with_(steps=8, start_percent=0.3, end_percent=0.8),
    ):
        stock = _run(r, wl, 41)
        both = _run(r, wl, 41, VARIANTS["fused+graph"])
        _close(host, stock, both)
        # both ran: the steps in graphs, the ControlNets through the fused merge
        assert badges.graph_counts(both)["replays"] > 0
        assert _fused_figures(both)["fused_merges"] >= 1


def test_stock_apply_then_fused_apply_chain(host, tiny_models):
    """A chain mixing a stock Apply (inner) with a Fused Apply (outer) equals the stock chain."""

    def outer_fused(p, ids):
        p[ids["apply_1"]]["class_type"] = "CNA_ControlNetApplyFused"

    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=6)
    stock = _run(r, wl, 42)
    mixed = _run(r, wl, 42, outer_fused)
    _close(host, stock, mixed)
    st = _fused_figures(mixed)
    assert st["fused_merges"] >= 1 and st["hint_encodes"] == 1, st  # the outer net fused


def test_a_first_kernel_build_shows_as_progress_before_sampling(
    host, tiny_models, monkeypatch, standin_compiler
):
    """Where the kernels would be used and are not built yet, the Fused node builds them while
    it runs, on ComfyUI's progress bar (one step per source and the link), before the sampler
    starts; later prompts build nothing. The compiler is a stand-in (no nvcc here) that writes
    the object files in turn, as ninja does."""
    import threading

    import comfy.utils

    pack = sys.modules[host.pack_module_name]
    k = pack.kernels
    monkeypatch.setattr(pack.nodes.kernel_build, "_comfy_on_cuda", lambda: True)
    jit, registry = k._jit, k.registry
    monkeypatch.setattr(registry, "_cuda_static_reason", lambda: None)  # as on a CUDA machine
    monkeypatch.setattr(registry, "_cuda_by_default", lambda op=None: True)
    monkeypatch.setattr(jit, "_gpu_visible", lambda: True)
    monkeypatch.setenv("CNA_CUDA_ARCH", "9.0")
    # the stand-in module is never called: the ops are held on their PyTorch path below
    _, loads = standin_compiler(jit)

    seen = []  # (value, total, node id) of every progress update, whoever set the hook
    set_hook = comfy.utils.set_progress_bar_global_hook

    def recording(hook):
        def both(value, total, preview, *a, **kw):
            seen.append((value, total, kw.get("node_id")))
            return hook(value, total, preview, *a, **kw)

        set_hook(None if hook is None else both)

    monkeypatch.setattr(comfy.utils, "set_progress_bar_global_hook", recording)
    total = len(jit.SOURCES) + 1
    steps = total + 1  # the sampler's bar: another total
    jit.reset_for_tests()
    import folder_paths

    wl = wf.WORKLOADS["T1"].with_(steps=steps)
    p, ids = wf.build_prompt(
        wl, 7, wf.write_hint_images(folder_paths.get_input_directory(), wl), FUSED
    )
    try:
        with k.use_backend("eager"):  # on a GPU too: the stand-in module has no kernels
            badges.run(runner.Runner(), p, ids)
            assert len(loads) == 1 and loads[0] != threading.get_ident()
            build = [(i, v) for i, (v, t, node) in enumerate(seen) if t == total]
            assert build and build[0][1] == 0 and build[-1][1] == total, seen
            # on the Fused node, all of it before the sampler's first step
            assert {str(seen[i][2]) for i, _ in build} == {str(ids["apply_0"])}, seen
            sampling = [i for i, (_, t, _) in enumerate(seen) if t == steps]
            assert sampling and build[-1][0] < sampling[0], seen
            seen.clear()
            _run(runner.Runner(), wl.with_(strength=0.9), 8, FUSED)
            assert len(loads) == 1 and seen and all(t == steps for _, t, _ in seen), seen
    finally:
        jit.reset_for_tests()


def test_strength_zero_returns_conditioning_untouched(host, tiny_models):
    mod = sys.modules[host.pack_module_name]
    pos, neg = [[torch.zeros(1, 2, 3), {}]], [[torch.zeros(1, 2, 3), {}]]
    out = mod.nodes.nodes_fused_apply.ControlNetApplyFused.execute(
        pos, neg, object(), torch.zeros(1, 8, 8, 3), strength=0.0
    )
    assert out.result[0] is pos and out.result[1] is neg


def test_unsupported_kind_runs_stock_path_with_one_log_line(host, tiny_models, caplog, monkeypatch):
    import comfy.controlnet

    fa = _fa(host)
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))

    class OtherControl(comfy.controlnet.ControlNet):  # stands in for kinds we do not fuse
        pass

    other = OtherControl(None)
    other.control_model, other.control_model_wrapped = cn.control_model, cn.control_model_wrapped
    cn.copy_to(other)
    assert "OtherControl" in fa.why_not_fusable(other)
    assert fa.why_not_fusable(cn) is None
    pos, neg = [[torch.zeros(1, 77, 768), {}]], [[torch.zeros(1, 77, 768), {}]]
    img = torch.rand(1, 64, 64, 3)
    monkeypatch.setattr(fa, "_logged", set())  # as in a fresh process
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        p1, n1 = fa.apply_fused(pos, neg, other, img, 1.0, 0.0, 1.0)
        fa.apply_fused(pos, neg, other, img, 1.0, 0.0, 1.0)
    assert type(p1[0][1]["control"]) is comfy.controlnet.ControlNet  # stock's own copy()
    assert p1[0][1]["control"] is n1[0][1]["control"]
    assert sum("runs the stock path" in r.message for r in caplog.records) == 1


def test_the_network_comfyui_holds_is_never_modified(host, tiny_models, monkeypatch):
    """The hint cache runs a copy of the network with a caching encoder: while it encodes, the
    network ComfyUI loaded still has its own encoder and no attribute of the pack's, and the
    copy is made once per network, not per step."""
    fa = _fa(host)
    made, seen = [], []
    real_hint_net, real_forward = fa.FusedControlNet._hint_net, fa._CachedHintBlock.forward

    def hint_net(self, model):
        view = real_hint_net(self, model)
        if view is not model and all(view is not v for _, v in made):
            made.append((model, view))
        return view

    def forward(self, hint, emb, context):
        for model, _ in made:
            seen.append(
                ("input_hint_block" in vars(model), type(model._modules["input_hint_block"]))
            )
        return real_forward(self, hint, emb, context)

    monkeypatch.setattr(fa.FusedControlNet, "_hint_net", hint_net)
    monkeypatch.setattr(fa._CachedHintBlock, "forward", forward)
    wl = wf.WORKLOADS["T2"].with_(steps=4)
    r = runner.Runner()
    stock = _run(r, wl, 33)
    fused = _run(r, wl, 33, FUSED)
    _close(host, stock, fused)
    assert len(made) == len(wl.controlnets), made  # one copy per network for the whole run
    assert seen and all(not attr for attr, _ in seen), seen
    assert all(issubclass(kind, torch.nn.Sequential) for _, kind in seen), seen
    for model, view in made:
        assert fa.network_of(view) is model and fa.network_of(model) is model
        assert view._modules["input_hint_block"].block is model._modules["input_hint_block"]


def test_fused_object_survives_copy_and_cleanup(host, tiny_models):
    import comfy.controlnet

    fa = _fa(host)
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    f = fa.FusedControlNet.from_controlnet(cn).set_cond_hint(torch.rand(1, 3, 64, 64), 0.8)
    c = f.copy()
    assert type(c) is fa.FusedControlNet and c.strength == 0.8
    assert c.control_model is cn.control_model
    assert c.fused_settings == f.fused_settings and c._run is not f._run  # a fresh run holder
    c._run.hint_enc, c._run.encodes = torch.zeros(1), 2
    c.cleanup()
    assert c._run.hint_enc is None and c._run.encodes == 0 and c.cond_hint is None


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(strength=11.0), "'strength' is 11.0, outside 0–10"),
        (dict(start_percent=-0.1), "'start_percent'"),
        (dict(image=torch.rand(64, 64, 3)), "'image' must be an IMAGE batch"),
        (dict(image=torch.rand(1, 0, 64, 3)), "'image' is empty"),
        (dict(image=torch.rand(1, 64, 64, 4)), "has 4 channels but this ControlNet expects 3"),
        (dict(image=torch.full((1, 64, 64, 3), float("nan"))), "NaN or infinite"),
        (dict(positive=[[torch.zeros(1, 77, 2048), {}]]), "SD1.5 ControlNet .* SDXL model"),
    ],
)
def test_bad_inputs_get_an_error_naming_node_input_and_fix(host, tiny_models, bad, match):
    import comfy.controlnet

    fa = _fa(host)
    errors = sys.modules[host.pack_module_name].errors
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    args = dict(
        positive=[[torch.zeros(1, 77, 768), {}]],
        negative=[[torch.zeros(1, 77, 768), {}]],
        control_net=cn,
        image=torch.rand(1, 64, 64, 3),
        strength=1.0,
        start_percent=0.0,
        end_percent=1.0,
    )
    args.update(bad)
    with pytest.raises(errors.NodeInputError, match=match) as e:
        fa.apply_fused(**args)
    assert str(e.value).startswith("Apply ControlNet (Fused): input '")
    assert e.value.fix  # every error says what to do


def _positive_only(p, ids):
    FUSED(p, ids)
    for node in p.values():
        if node["class_type"] == "CNA_ControlNetApplyFused":
            node["inputs"]["positive_only"] = True


def test_positive_only_runs_the_controlnets_on_half_the_batch(host, tiny_models, monkeypatch):
    import comfy.cldm.cldm

    batches = []
    orig = comfy.cldm.cldm.ControlNet.forward

    def spy(self, x, *a, **k):
        batches.append(x.shape[0])
        return orig(self, x, *a, **k)

    monkeypatch.setattr(comfy.cldm.cldm.ControlNet, "forward", spy)
    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=6)
    stock = _run(r, wl, 51)
    full = list(batches)
    batches.clear()
    half = _run(r, wl, 51, _positive_only)
    assert full and set(full) == {2}  # cond + uncond
    assert batches and set(batches) == {1}  # the positive chunk only
    assert _fused_figures(half)["positive_only"] == wl.steps
    rel = ((half.latent - stock.latent).norm() / stock.latent.norm()).item()
    assert 0 < rel < 0.5, rel  # changed (the negative half gets the positive's features), sane
    # with the CUDA Graph node it is the same computation
    both = _run(r, wl, 51, _chain(_positive_only, VARIANTS["cuda_graph"]))
    if host.cpu:
        assert torch.equal(both.latent, half.latent)
    else:
        assert runner.psnr(half.latent, both.latent) >= 45.0


def test_positive_only_changes_nothing_without_a_negative_batch(host, tiny_models):
    """cfg 1.0: ComfyUI skips the negative pass, so there is no half to save."""
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4, cfg=1.0)
    stock = _run(r, wl, 52)
    got = _run(r, wl, 52, _positive_only)
    _close(host, stock, got)
    st = _fused_figures(got)
    assert st["fused_merges"] >= 1 and st["positive_only"] == 0, st
