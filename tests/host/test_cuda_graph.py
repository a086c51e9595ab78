# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA Graph Sampler nodes against stock ComfyUI, on the same random weights and seeds.

On a CPU the graph path runs in emulation (``CNA_GRAPH_BACKEND=emulate``): the same capture,
static-buffer and fallback logic, with "replay" calling the function on the static buffers, so a
buffer the glue forgets to refresh shows up as a wrong result. With ``CNA_TEST_GPU=1`` on a GPU
the real CUDA graphs run. Tolerance: bit-identical in emulation (same kernels, same order); on
the GPU the replayed kernels are the eager ones, so we expect bit-identical too and accept
PSNR ≥ 60 dB on the final latent (fp16 rounding, if cuDNN picked another algorithm under
capture), far above the ~25 dB that one changed ControlNet gives.
"""

from __future__ import annotations

import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import badges, runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _chain

pytestmark = [pytest.mark.host, pytest.mark.captures, pytest.mark.usefixtures("graph_backend")]
MIN_PSNR_GPU = 60.0


def _cg(host):
    return sys.modules[host.pack_module_name].nodes.cuda_graph


# The model's counters (captures, replays, eager, failed, released), kept by its graph state:
# build_prompt names the checkpoint loader "ckpt" in every workflow of these tests.
CKPT = {"ckpt": wf.build_prompt(wf.WORKLOADS["T0"], 0, ["x"])[1]["ckpt"]}


def _model(r) -> dict:
    return badges.model_graph_counts(r, CKPT)


def _delta(before, after):
    return {k: after[k] - before[k] for k in before}


def _run(r, wl, seed, extra=None, **kw):
    """Run the workflow; the result carries its nodes' badges (``badges.graph_counts``)."""
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints, extra)
    return badges.run(r, p, ids, **kw), p, ids


def _same(host, a, b):
    if host.cpu:
        assert torch.equal(a.latent, b.latent), runner.psnr(a.latent, b.latent)
    else:
        assert runner.psnr(a.latent, b.latent) >= MIN_PSNR_GPU, runner.psnr(a.latent, b.latent)


def _replayed(host, res):
    """The run's steps ran in graphs: equal to stock is not enough, eager is equal too. (Where
    DynamicVRAM is on, the node may hand the model on instead: test_dynamic_vram.py.)"""
    if not host.dynamic_vram:
        assert badges.graph_counts(res)["replays"] > 0, badges.graph_counts(res)


GRAPH = VARIANTS["cuda_graph"]
CASES = {
    "0cn": wf.WORKLOADS["T0"],
    "1cn": wf.WORKLOADS["T1"],
    "2cn": wf.WORKLOADS["T2"],
    "2cn-range": wf.WORKLOADS["T2"].with_(start_percent=0.25, end_percent=0.7),
    "1cn-strength": wf.WORKLOADS["T1"].with_(strength=0.6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_graph_matches_stock_over_20_steps(host, tiny_models, case):
    wl = CASES[case].with_(steps=20)
    r = runner.Runner()
    stock, _, _ = _run(r, wl, 21)
    before = _model(r)
    graph, _, _ = _run(r, wl, 21, GRAPH)
    d, m = badges.graph_counts(graph), _delta(before, _model(r))
    _same(host, stock, graph)
    assert d["captures"] >= 1 and d["replays"] >= 15 and m["failed"] == 0, (d, m)
    assert m["captures"] == d["captures"] and m["replays"] == d["replays"], (d, m)


def test_strength_change_replays_without_recapture(host, tiny_models):
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=6)
    _run(r, wl, 3, GRAPH)
    graphs = []
    for s in (0.4, 1.7):
        w = wl.with_(strength=s)
        graph, _, _ = _run(r, w, 3, GRAPH)
        stock, _, _ = _run(r, w, 3)
        _same(host, stock, graph)
        graphs.append(graph)
    d = badges.graph_counts(graphs)
    assert d["captures"] == 0 and d["replays"] >= 8, d


def _count_hint_encodes(monkeypatch) -> list:
    """Counts the hint encoder's runs: its first convolution is the only one fed the 3-channel
    hint image (the UNet's first takes the 4-channel latent)."""
    calls: list = []
    conv = torch.nn.Conv2d._conv_forward

    def counting(self, x, weight, bias):
        if x.shape[-3] == 3:
            calls.append(tuple(x.shape))
        return conv(self, x, weight, bias)

    monkeypatch.setattr(torch.nn.Conv2d, "_conv_forward", counting)
    return calls


def test_hint_encoded_once_per_run_outside_the_graph_and_a_new_hint_replays(
    host, tiny_models, monkeypatch
):
    """The ControlNet's hint encoder runs outside the graph: once when the graph is captured
    (or at a run's first replay) instead of at every step, and a new hint image of the same size
    replays the same graph with its own encoding. Every result is stock's, bit for bit."""
    import folder_paths

    wl = CASES["1cn"].with_(steps=6)
    other = wf.write_hint_images(
        folder_paths.get_input_directory(), wl.with_(controlnets=("a", "b"))
    )

    def other_hint(p, ids):
        p[ids["hint_0"]]["inputs"]["image"] = other[1]

    r = runner.Runner()
    stock_a, _, _ = _run(r, wl, 31)
    stock_b, _, _ = _run(r, wl, 31, other_hint)
    assert not torch.equal(stock_a.latent, stock_b.latent)  # the hint matters
    calls = _count_hint_encodes(monkeypatch)
    stock_a2, _, _ = _run(r, wl, 32)  # another seed: ComfyUI would serve a repeat from cache
    assert len(calls) == 6, calls  # stock: every step (cond and uncond in one batch)
    results = []
    runs = ((GRAPH, 31, stock_a), (GRAPH, 32, stock_a2), (_chain(other_hint, GRAPH), 31, stock_b))
    for extra, seed, stock in runs:
        del calls[:]
        got, _, _ = _run(r, wl, seed, extra)
        _same(host, stock, got)
        results.append((badges.graph_counts(got), len(calls)))
    (first, n1), (again, n2), (new_hint, n3) = results
    assert first["captures"] == 1 and first["replays"] == 4, first
    # step 0 runs stock (ComfyUI prepares the hint), then one encode for the graph's buffer
    assert n1 == 2, n1
    assert again["captures"] == 0 and n2 == 2, (again, n2)  # one encode at the first replay
    assert new_hint["captures"] == 0 and new_hint["replays"] == 5 and n3 == 2, (new_hint, n3)


def test_resolution_change_and_back(host, tiny_models):
    r = runner.Runner()
    small = wf.WORKLOADS["T1"].with_(steps=5)
    big = small.with_(width=96, height=80)
    graphs = []
    for wl in (small, big, small, big):
        graph, _, _ = _run(r, wl, 8, GRAPH)
        stock, _, _ = _run(r, wl, 8)
        _same(host, stock, graph)
        graphs.append(graph)
    d = badges.graph_counts(graphs)
    assert d["captures"] == 2, d  # one per size, the second visit of each size replays


def test_alternating_workflows_on_one_model(host, tiny_models):
    r = runner.Runner()
    for wl in (wf.WORKLOADS["T1"], wf.WORKLOADS["T2"], wf.WORKLOADS["T0"], wf.WORKLOADS["T1"]):
        wl = wl.with_(steps=5)
        graph, _, _ = _run(r, wl, 4, GRAPH)
        stock, _, _ = _run(r, wl, 4)
        _same(host, stock, graph)
        _replayed(host, graph)


def test_capture_failure_falls_back_to_eager_with_reason(host, tiny_models, monkeypatch, caplog):
    """A fault inside capture (on a GPU: a real illegal host sync) ends in the stock result, the
    reason logged once, and no capture retried on later steps or runs."""
    import comfy.ldm.modules.diffusionmodules.openaimodel as oa

    cg = _cg(host)
    orig = oa.UNetModel._forward

    # On a GPU with the native allocator the fault is a real illegal host sync (the driver
    # invalidates the capture); under cudaMallocAsync PyTorch cannot survive that (see
    # tests/graphs), so there the fault is an exception raised inside the capture.
    real_sync = x_is_cuda = not host.cpu
    if x_is_cuda and torch.cuda.memory.get_allocator_backend() == "cudaMallocAsync":
        real_sync = False

    def faulty(self, x, *a, **k):
        capturing = any(s.cache.capturing for s in cg._STATES.values())
        if capturing:
            if real_sync:
                float(x.sum())  # illegal while the stream is capturing
            else:
                raise RuntimeError("injected capture fault")
        return orig(self, x, *a, **k)

    monkeypatch.setattr(oa.UNetModel, "_forward", faulty)
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=6)
    stock, _, _ = _run(r, wl, 9)
    before = _model(r)
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        g1, _, _ = _run(r, wl, 9, GRAPH)
        g2, _, _ = _run(r, wl, 10, GRAPH)
    d = _delta(before, _model(r))
    _same(host, stock, g1)
    assert d["failed"] == 1 and d["captures"] == 0 and d["replays"] == 0, d
    assert badges.graph_counts([g1, g2])["replays"] == 0
    warned = [rec.message for rec in caplog.records if "CUDA graph disabled" in rec.message]
    assert len(warned) == 1 and ("injected" in warned[0] or "capture" in warned[0]), warned
    assert g2.latent.isfinite().all()


def test_interrupted_run_then_next_run_still_matches(host, tiny_models):
    import comfy.model_management

    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=8)

    seen = []

    def interrupt(step):
        seen.append(step)
        if step == 3:
            comfy.model_management.interrupt_current_processing(True)

    with pytest.raises(runner.WorkflowFailed, match="interrupted"):
        _run(r, wl, 12, GRAPH, on_step=interrupt)
    assert seen[-1] == 3  # stopped inside sampling, not after it
    graph, _, _ = _run(r, wl, 13, GRAPH)
    stock, _, _ = _run(r, wl, 13)
    _same(host, stock, graph)
    _replayed(host, graph)


def test_a_model_that_cannot_be_captured_runs_stocks_step_untouched(host, tiny_models, monkeypatch):
    """A model the run cannot capture (DynamicVRAM, lowvram; simulated here by the capture
    check) gets stock's own step: the ControlNet calls are not deferred into the model call,
    the result is stock's bit for bit, and every call is counted eager with the reason."""
    cg = _cg(host)
    compat = sys.modules[host.pack_module_name].nodes.compat
    deferred = []
    real_defer = cg.defer_controls

    def counting_defer(conds):
        deferred.append(1)
        return real_defer(conds)

    monkeypatch.setattr(cg, "defer_controls", counting_defer)
    monkeypatch.setattr(compat, "capture_blocker", lambda module: "weights managed elsewhere")
    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=4)
    stock, _, _ = _run(r, wl, 31)
    graph, _, _ = _run(r, wl, 31, GRAPH)
    assert torch.equal(stock.latent, graph.latent)
    assert not deferred
    (d,) = badges.data(graph, "cuda_graph")
    assert (d["captures"], d["replays"]) == (0, 0) and d["eager"] >= 4, d
    assert d.get("eager_reasons") == ["weights managed elsewhere"], d


def test_models_unloaded_and_reloaded_between_runs(host, tiny_models):
    import comfy.model_management

    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=5)
    _run(r, wl, 2, GRAPH)
    before = _model(r)
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()
    assert _delta(before, _model(r))["released"] >= 1  # graphs freed with the model
    graph, _, _ = _run(r, wl, 2 + 1, GRAPH)
    stock, _, _ = _run(r, wl, 2 + 1)
    _same(host, stock, graph)
    _replayed(host, graph)


def test_graphs_on_weights_moved_between_runs_are_dropped_as_the_next_run_starts(
    host, tiny_models, caplog
):
    """ComfyUI moved weights between runs without unloading the model (a partial unload to make
    room for another model, then the reload): the graphs that read them are dropped as the next
    run starts, before ComfyUI loads its models, so their memory pool does not stand in the way
    of the load and the first step; the run captures anew and matches stock."""
    cg = _cg(host)
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=5)
    _run(r, wl, 2, GRAPH)
    ((base, st),) = [(b, s) for b, s in cg._STATES.items() if s.cache.entries]
    p0 = next(base.diffusion_model.parameters())
    with torch.inference_mode(p0.is_inference()):
        p0.data = p0.data.clone()  # a new address, the same values
    before = _model(r)
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        graph, _, _ = _run(r, wl, 3, GRAPH)
    said = [m.message for m in caplog.records if "dropped" in m.message]
    assert any("weights moved since the last run" in m for m in said), said
    assert not any("reloaded or re-patched" in m for m in said), said  # not left to the lookup
    d = _delta(before, _model(r))
    assert d["released"] >= 1 and d["captures"] >= 1, d
    stock, _, _ = _run(r, wl, 3)
    _same(host, stock, graph)
    # weights in place: the next run keeps its graphs
    before = _model(r)
    again, _, _ = _run(r, wl, 3, GRAPH)
    d = _delta(before, _model(r))
    assert d["released"] == 0 and d["captures"] == 0 and d["replays"] >= 1, d
    _same(host, stock, again)


def test_per_step_patches_run_eager_with_reason(host, tiny_models, caplog):
    def freeu_then_graph(p, ids):
        fu = str(max(int(k) for k in p) + 1)
        p[fu] = {
            "class_type": "FreeU_V2",
            "inputs": {"model": [ids["ckpt"], 0], "b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2},
        }
        g = str(int(fu) + 1)
        p[g] = {
            "class_type": "CNA_CUDAGraph",
            "inputs": {"model": [fu, 0], "enabled": True, "max_graphs": 8, "verify": False},
        }
        p[ids["sampler"]]["inputs"]["model"] = [g, 0]

    def freeu_only(p, ids):
        fu = str(max(int(k) for k in p) + 1)
        p[fu] = {
            "class_type": "FreeU_V2",
            "inputs": {"model": [ids["ckpt"], 0], "b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2},
        }
        p[ids["sampler"]]["inputs"]["model"] = [fu, 0]

    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4)
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        graph, _, _ = _run(r, wl, 6, freeu_then_graph)
    stock, _, _ = _run(r, wl, 6, freeu_only)
    assert torch.equal(stock.latent, graph.latent)
    d = badges.graph_counts(graph)
    assert d["captures"] == 0 and d["eager"] >= wl.steps, d
    assert any("per-block patches" in rec.message for rec in caplog.records)


def test_ksampler_cuda_graph_node_matches_ksampler(host, tiny_models):
    def use_node(p, ids):
        s = p[ids["sampler"]]
        s["class_type"] = "CNA_KSamplerCUDAGraph"
        s["inputs"].update(enabled=True, max_graphs=8, verify=True)

    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=6)
    stock, _, _ = _run(r, wl, 14)
    before = _model(r)
    graph, _, _ = _run(r, wl, 14, use_node)
    _same(host, stock, graph)
    d = _delta(before, _model(r))
    assert d["captures"] >= 1 and d["failed"] == 0, d
    assert badges.graph_counts(graph)["captures"] == d["captures"]  # the node's own badge


def test_sampler_custom_advanced_with_graph_model(host, tiny_models):
    def custom(graph: bool):
        def extra(p, ids):
            k = p.pop(ids["sampler"])["inputs"]
            model = [ids["ckpt"], 0]
            n = max(int(x) for x in p) + 1

            def add(ct, **inputs):
                nonlocal n
                p[str(n)] = {"class_type": ct, "inputs": inputs}
                n += 1
                return str(n - 1)

            if graph:
                model = [
                    add("CNA_CUDAGraph", model=model, enabled=True, max_graphs=8, verify=False),
                    0,
                ]
            noise = add("RandomNoise", noise_seed=k["seed"])
            guider = add(
                "CFGGuider",
                model=model,
                positive=k["positive"],
                negative=k["negative"],
                cfg=k["cfg"],
            )
            sampler = add("KSamplerSelect", sampler_name="dpmpp_2m")
            sigmas = add(
                "BasicScheduler", model=model, scheduler="karras", steps=k["steps"], denoise=1.0
            )
            out = add(
                "SamplerCustomAdvanced",
                noise=[noise, 0],
                guider=[guider, 0],
                sampler=[sampler, 0],
                sigmas=[sigmas, 0],
                latent_image=k["latent_image"],
            )
            ids["sampler"] = out
            p[ids["out"]]["inputs"]["samples"] = [out, 0]

        return extra

    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=6)
    stock, _, _ = _run(r, wl, 15, custom(False))
    graph, _, _ = _run(r, wl, 15, custom(True))
    _same(host, stock, graph)
    assert badges.graph_counts(graph)["replays"] >= 3


def test_disabled_node_returns_model_unchanged(host, tiny_models):
    mod = sys.modules[host.pack_module_name]
    cls = mod.nodes.nodes_cuda_graph.CUDAGraphModel
    sentinel = object()
    assert cls.execute(sentinel, enabled=False).result[0] is sentinel


def test_cpu_without_emulation_runs_eager_and_says_why(host, tiny_models, monkeypatch, caplog):
    if not host.cpu:
        pytest.skip("checks the CPU path")
    monkeypatch.delenv("CNA_GRAPH_BACKEND", raising=False)
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4)
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        graph, _, _ = _run(r, wl, 16, GRAPH)
    stock, _, _ = _run(r, wl, 16)
    assert torch.equal(stock.latent, graph.latent)
    d = badges.graph_counts(graph)
    assert d["captures"] == 0 and d["eager"] >= 4, d
    assert any("no CUDA device" in rec.message for rec in caplog.records)


def test_batch_two_img2img_and_ksampler_advanced(host, tiny_models):
    """Batch 2 (CFG batch 4, hint broadcast), partial denoise, and KSamplerAdvanced with a step
    window: each equals stock under the graph path."""

    def advanced(p, ids):
        s = p[ids["sampler"]]
        k = s["inputs"]
        s["class_type"] = "KSamplerAdvanced"
        s["inputs"] = {
            "model": k["model"],
            "add_noise": "enable",
            "noise_seed": k["seed"],
            "steps": k["steps"],
            "cfg": k["cfg"],
            "sampler_name": "euler_ancestral",
            "scheduler": "karras",
            "positive": k["positive"],
            "negative": k["negative"],
            "latent_image": k["latent_image"],
            "start_at_step": 1,
            "end_at_step": 6,
            "return_with_leftover_noise": "disable",
        }

    def denoise(p, ids):
        p[ids["sampler"]]["inputs"]["denoise"] = 0.6

    r = runner.Runner()
    base = wf.WORKLOADS["T2"].with_(steps=7)
    for wl, change in ((base.with_(batch_size=2), None), (base, denoise), (base, advanced)):

        def with_graph(p, ids, change=change):
            if change is not None:
                change(p, ids)
            GRAPH(p, ids)

        stock, _, _ = _run(r, wl, 17, change)
        graph, _, _ = _run(r, wl, 17, with_graph)
        _same(host, stock, graph)
        assert badges.graph_counts(graph)["replays"] >= 2


@pytest.mark.parametrize("case", ["1cn", "2cn-range"])
def test_controlnets_on_a_second_stream_match_stock(host, tiny_models, case):
    """concurrent_controlnet: the ControlNets run beside the UNet's input blocks inside the
    graph (on the GPU; on the CPU the option changes nothing). Same result as stock."""
    wl = CASES[case].with_(steps=20)
    r = runner.Runner()
    stock, _, _ = _run(r, wl, 22)
    before = _model(r)
    conc, _, _ = _run(r, wl, 22, VARIANTS["fused+graph_cc"])
    d, m = badges.graph_counts(conc), _delta(before, _model(r))
    _same(host, stock, conc)
    assert d["captures"] >= 1 and d["replays"] >= 15 and m["failed"] == 0, (d, m)
    # a second run (another seed: the same prompt would be answered from ComfyUI's output
    # cache) replays the graphs, and gives stock's result for its seed
    again, _, _ = _run(r, wl, 23, VARIANTS["fused+graph_cc"])
    d = badges.graph_counts(again)
    assert d["captures"] == 0 and d["replays"] >= 15, d
    _same(host, _run(r, wl, 23)[0], again)


def test_side_stream_residuals_live_until_the_unet_has_read_them(host, tiny_models, monkeypatch):
    """Residuals made on the ControlNets' stream are freed on that stream, so they must not be
    freed as the UNet pops them (that free would not be ordered after the UNet's reads: in a
    graph captured under cudaMallocAsync, an illegal memory access at the replay). Each one the UNet
    pops stays alive until its last block, and is gone once the step function has returned."""
    if host.cpu:
        pytest.skip("GPU only: on the CPU there is no second stream (concurrent_controlnet)")
    import importlib
    import weakref

    cg = _cg(host)
    oam = importlib.import_module("comfy.ldm.modules.diffusionmodules.openaimodel")
    orig = oam.apply_control
    st = {"control": None, "popped": [], "forwards": 0, "early": 0, "kept": 0}

    def spy(h, control, name):
        if isinstance(control, cg._JoinOnUse):
            if control is not st["control"]:  # a new step function call
                st["kept"] += sum(r() is not None for r in st["popped"])
                st["control"], st["popped"] = control, []
                st["forwards"] += 1
            st["early"] += sum(r() is None for r in st["popped"])
            if name in control and len(control[name]) > 0 and control[name][-1] is not None:
                st["popped"].append(weakref.ref(control[name][-1]))
        return orig(h, control, name)

    monkeypatch.setattr(oam, "apply_control", spy)
    wl = CASES["2cn"].with_(steps=6)
    _run(runner.Runner(), wl, 23, VARIANTS["fused+graph_cc"])
    assert st["forwards"] >= 2, st  # warm-up and capture ran the function eagerly
    assert st["early"] == 0, st  # popped, read, and still alive while the UNet runs
    assert st["kept"] == 0, st  # and not kept past the step (so the check above can fail)


def test_join_on_use_waits_only_for_residuals_it_hands_out(host):
    cg = _cg(host)
    waits = []

    class Ev:
        pass

    d = cg._JoinOnUse({"input": [], "middle": ["m"], "output": ["o"]}, Ev())
    d._join = lambda: waits.append(1)  # count instead of touching a stream
    assert "input" in d and d["input"] == [] and not waits  # empty: nothing to wait for
    assert "middle" in d and not waits  # membership alone never waits
    assert d["middle"] == ["m"] and waits == [1]
    assert d.get("missing") is None


# What the pack's own ControlNet classes add to ComfyUI's: their settings (fixed when the Apply
# or Cache node makes the object) and their per-run holders. Anything else left on an object
# after a run is state that leaked onto ComfyUI's objects.
PACK_ATTRS = {"fused_settings", "_run", "_raw", "_hint_view", "cache_settings", "_crun"}


def test_a_run_leaves_nothing_on_comfyuis_objects(host, tiny_models):
    """Graph + fused + cache, two nets with a partial range (the active mask, passthrough and
    cache decisions all in use): afterwards no ControlNet, network or model patcher carries an
    attribute the pack set, and the graph node's run holder is back to its template state."""
    import gc

    import comfy.controlnet
    import comfy.model_patcher
    from comfyui_controlnet_accelerator.harness.quick import _chain, _feature_cache

    cg = _cg(host)
    cache = _feature_cache(mode="every_n", every_n=2, max_reuse=1)
    wl = CASES["2cn-range"].with_(steps=6)
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    r = runner.Runner()  # kept: its node cache holds the run's objects
    res, _, _ = _run(r, wl, 24, _chain(cache, VARIANTS["fused+graph"]))
    assert badges.graph_counts(res)["replays"] >= 2  # the graph path really ran
    gc.collect()
    new = [o for o in gc.get_objects() if id(o) not in before]
    controls = [o for o in new if isinstance(o, comfy.controlnet.ControlBase)]
    patchers = [o for o in new if isinstance(o, comfy.model_patcher.ModelPatcher)]
    kinds = {type(o).__name__ for o in controls}
    assert {"CachedControlNet"} <= kinds, kinds
    leaked = []
    for o in controls + patchers:
        leaked += [f"{type(o).__name__}.{k}" for k in vars(o) if k.startswith("cna")]
    for o in controls:
        stock = comfy.controlnet.ControlNet.copy(o)  # ComfyUI's own attributes, as it copies
        extra = set(vars(o)) - set(vars(stock)) - PACK_ATTRS
        leaked += [f"{type(o).__name__}.{k}" for k in sorted(extra)]
        if "input_hint_block" in vars(o.control_model):
            leaked.append("control_model.input_hint_block (swapped block left behind)")
    assert not leaked, leaked
    patches = [
        fn.__self__
        for p in patchers
        for fn in p.wrappers.get("outer_sample", {}).get(cg.WRAPPER_KEY, [])
    ]
    assert patches, "the CUDA Graph node's model should carry its wrappers"
    for patch in patches:  # the run's holder was a clone: nothing accumulated on the template
        r = patch.template
        assert r.calls == 0 and r.evaluations == 0 and not r.plans and r.last is None


def test_badge_reports_host_time_and_the_plan_is_rebuilt_only_for_a_new_signature(
    host, tiny_models
):
    """The node's badge data carries the run's own figures (its holder, not process totals),
    the host time spent in the pack's wrappers per step (ComfyUI's model calls excluded), and
    how many calls took the slow path: with one ControlNet on every step, only the call that
    captured (step 0 runs eager while the ControlNet prepares its hint)."""
    status = sys.modules[host.pack_module_name].nodes.status
    wl = CASES["1cn"].with_(steps=8)
    r = runner.Runner()
    _run(r, wl, 26)  # load everything first
    before = _model(r)
    _, p, _ = _run(r, wl, 26, GRAPH)
    d = _delta(before, _model(r))
    node = next(k for k, v in p.items() if v["class_type"] == "CNA_CUDAGraph")
    data = status.LAST[node]["data"]
    assert (data["captures"], data["replays"], data["eager"]) == (1, 6, 1), data
    assert (d["captures"], d["replays"], d["eager"]) == (1, 6, 1), d
    assert data["plans_built"] == 1, data
    assert 0 < data["host_ms_per_step"] < data["ms_per_step"], data
    assert 0 <= data["launch_ms_per_step"] < data["ms_per_step"], data
    # the replayed calls' own host time: no planning from scratch, no capture, no eager step
    assert 0 < data["host_ms_per_replay"] < data["host_ms_per_step"] * 8 / 6, data


def _two_prompts(p, ids):
    """The positive prompt for the first half of the steps, another for the second half: the
    text context the graph receives changes mid-run, its shape does not."""
    ckpt, pos = ids["ckpt"], ids["pos"]
    p["90"] = {"class_type": "CLIPTextEncode", "inputs": {"text": "a red door", "clip": [ckpt, 1]}}
    p["91"] = {
        "class_type": "ConditioningSetTimestepRange",
        "inputs": {"conditioning": [pos, 0], "start": 0.0, "end": 0.5},
    }
    p["92"] = {
        "class_type": "ConditioningSetTimestepRange",
        "inputs": {"conditioning": ["90", 0], "start": 0.5, "end": 1.0},
    }
    p["93"] = {
        "class_type": "ConditioningCombine",
        "inputs": {"conditioning_1": ["91", 0], "conditioning_2": ["92", 0]},
    }
    for nid, node in p.items():
        if nid != "91":
            for k, v in node["inputs"].items():
                if v == [pos, 0]:
                    node["inputs"][k] = ["93", 0]


def _hoists(host, r) -> list:
    """The context projections of every graph the workflow's model holds."""
    gs = sys.modules[host.pack_module_name].nodes.graph_state
    st = gs.existing_state(r.output_of(CKPT["ckpt"])[0].model)
    return [e.extras.get("context_hoist") for e in st.cache.entries.values()]


def test_the_context_projections_follow_a_prompt_that_changes_mid_run(
    host, tiny_models, monkeypatch
):
    """The cross-attentions' key and value projections run once per text context inside the
    graph: a prompt that changes at the middle step, and another prompt in the next run, must
    give stock's result."""
    monkeypatch.setenv("CNA_CONTEXT_HOIST", "1")
    wl = wf.WORKLOADS["T2"].with_(steps=8)
    r = runner.Runner()
    stock, _, _ = _run(r, wl, 5, _two_prompts)
    graph, _, _ = _run(r, wl, 5, _chain(_two_prompts, GRAPH))
    _same(host, stock, graph)
    d = badges.graph_counts(graph)
    assert d["captures"] >= 1 and d["replays"] >= 6, d
    hoists = [h for h in _hoists(host, r) if h is not None]
    hoist = sys.modules[host.pack_module_name].graphs.context_hoist
    why = None if host.cpu else hoist.available()
    if why is not None:  # e.g. under cudaMallocAsync: the projections stay in the step
        assert not hoists, why
        return
    assert hoists, "no graph hoisted the context projections"
    unet = r.output_of(CKPT["ckpt"])[0].model.diffusion_model
    n_unet = len(hoist.cross_attention_weights([unet]))
    for h in hoists:  # the UNet's and both ControlNets' projections, answered from buffers
        assert h.hoisted == sum(len(g.weights) for g in h.groups) > n_unet > 0, (h.hoisted, n_unet)
        assert h.computed == 0

    def other_prompt(p, ids):
        p[ids["pos"]]["inputs"]["text"] = "a blue window"

    stock, _, _ = _run(r, wl, 5, other_prompt)
    graph, _, _ = _run(r, wl, 5, _chain(other_prompt, GRAPH))
    _same(host, stock, graph)
    assert badges.graph_counts(graph)["captures"] == 0  # same shapes: the same graphs replay
