# SPDX-License-Identifier: GPL-3.0-or-later
"""Reliability (issue #9, items 1 and 2): bad input and injected faults, on the real host.

Fault → test. Nodes: F Apply ControlNet (Fused), C Feature Cache, P Memory Pool, G CUDA Graph,
KG KSampler (CUDA Graph). Files: "here" this one; FA, FC, MP, CG, CL tests/host/test_fused_apply,
_feature_cache, _memory_pool, _cuda_graph, _channels_last; SG tests/graphs/test_static_graph;
KO, KB, BF tests/kernels/test_ops, test_build, test_build_faults. Test names without "test_".
All run on the CPU (graphs emulated, ``CNA_GRAPH_BACKEND=emulate``) except those marked GPU;
KB needs nvcc but no GPU.

1. Bad input: an error naming the node, the input and the fix
wrong family vs conditioning (F)   FA::bad_inputs_get_an_error_naming_node_input_and_fix[bad6]
wrong family vs model (P)         here::memory_pool_refuses_a_controlnet_of_another_family
wrong family vs model (KG)         here::ksampler_graph_refuses_a_controlnet_of_another_family
wrong family (C, G)               n/a: no model or conditioning input; downstream nodes check
hint of zero size (F)              FA::bad_inputs_…[bad3] (height 0)
                                   here::fused_more_bad_values (batch 0, width 0)
hint with wrong channels (F)       FA::bad_inputs_…[bad4] (4)
                                   here::fused_more_bad_values (1)
                                   here::rgba_hint_is_refused_at_the_apply_node (end to end)
NaN or inf in the hint (F)         FA::bad_inputs_…[bad5] (NaN)
                                   here::fused_more_bad_values (+inf, -inf)
strength, start/end out of range   FA::bad_inputs_…[bad0, bad1] (strength 11, start -0.1)
(F)                                here::fused_more_bad_values (strength -0.5 and NaN, end 1.5)
values out of range from a link    here::feature_cache_linked_values_get_a_named_error
(C)
reuse_start > reuse_end (C)       here::feature_cache_widget_values_are_refused_before_the_run
max_graphs from a link (G, KG)     here::max_graphs_out_of_range_gets_a_named_error
unknown weight mode from a link    here::memory_pool_refuses_an_unknown_weight_mode
(P)
truncated / corrupted ControlNet   here::broken_controlnet_file_stops_at_the_stock_loader: stock's
file (stock loader)                error, before any of our nodes (see that test)
unsupported kind → stock, a note   FA::unsupported_kind_runs_stock_path_with_one_log_line
(F)
unsupported kind passes through,   here::feature_cache_passes_unsupported_kinds_through_with_a_note
with a note (C)
unsupported kind passes through,   MP::unsupported_controlnets_pass_through
with a note (P)                   here::memory_pool_passes_unsupported_kinds_through_with_a_note
unsupported kind → eager, reason   here::unsupported_control_kind_runs_eager_with_the_reason
(G)

2. Faults
extension build fails → eager      KO::forced_build_failure_falls_back_to_eager_with_a_warning
                                   KO::force_eager_switch
capture raises → eager with the    CG::capture_failure_falls_back_to_eager_with_reason
reason (G)                         SG::failure_during_capture_is_remembered_and_eager_result_
                                     returned
                                   GPU: SG::cuda_capture_error_leaves_cuda_usable,
                                   SG::cuda_capture_invalidated_by_the_driver_is_survived
out of memory in capture or a      here::out_of_memory_in_capture_releases_graphs_and_runs_eager
graph's static buffers (G)         (injected; a real OOM inside a CUDA capture: GPU, untested)
out of memory allocating the       here::out_of_memory_in_the_feature_cache_runs_uncached
stores (C)
out of memory compressing weights  here::out_of_memory_while_compressing_keeps_weights_as_loaded
(P)                                here::out_of_memory_for_one_layer_on_the_gpu_quantizes_it_
                                   on_the_cpu
interrupt mid-run → next run       here::interrupt_mid_sampling_then_the_next_run_is_clean
clean (all)                        CG::interrupted_run_then_next_run_still_matches,
                                   MP::interrupted_pooled_run_leaves_nothing_behind and
                                   CL::interrupted_run_still_puts_the_weights_back interrupt only
                                   at the node after the sampler (no server hook raises it inside)
model unloaded between runs        CG::models_unloaded_and_reloaded_between_runs (G)
                                   MP::models_unloaded_between_pooled_runs (P)
                                   here::models_unloaded_between_runs_of_every_node (C, F, G)
two workflows alternating          CG::alternating_workflows_on_one_model (G)
                                   FC::two_workflows_alternating_on_one_network_keep_their_graphs
                                   MP::no_growth_over_repeated_runs (P and stock)
                                   here::two_workflows_alternating_give_their_own_results (all)
two processes building the         KB::two_processes_build_the_extension_at_once (slow; nvcc,
extension at once                  no GPU needed); BF (stale lock, threads)
"""

from __future__ import annotations

import gc
import sys
import types
import uuid
import weakref

import pytest
import torch
from comfyui_controlnet_accelerator.harness import badges, runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _chain, _feature_cache

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

T1 = wf.WORKLOADS["T1"].with_(steps=6)
T2 = wf.WORKLOADS["T2"].with_(steps=6)
GRAPH = VARIANTS["cuda_graph"]
EVERY2 = _feature_cache(mode="every_n", every_n=2, max_reuse=1)
NEVER = _feature_cache(mode="adaptive", threshold=0.0, max_reuse=3)  # stores, never reuses
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# The checkpoint loader's node id (the same in every workflow here): the graph counters of a
# runner's model are read through it (badges.model_graph_counts).
CKPT = {"ckpt": wf.build_prompt(T1, 0, ["x"])[1]["ckpt"]}


def _pack(host):
    return sys.modules[host.pack_module_name]


def _input_dir():
    import folder_paths

    return folder_paths.get_input_directory()


def _prompt(wl, seed, extra=None):
    return wf.build_prompt(wl, seed, wf.write_hint_images(_input_dir(), wl), extra)


def _run(r, wl, seed, extra=None, **kw):
    """Run the workflow; the result carries its nodes' badges (the run's own figures)."""
    p, ids = _prompt(wl, seed, extra)
    return badges.run(r, p, ids, **kw)


def _cache_calls(res) -> dict:
    """The run's ControlNet network calls computed and reused (Feature Cache badges)."""
    return badges.summed(res, "feature_cache", ("computed", "reused"), sub="calls")


def _fresh(wl, seed, extra=None, **kw):
    """A run in a new executor, as a fresh process gives it. The executor (a reference cycle
    holding every model its prompt loaded) is collected right away, so reference runs do not
    pile up in memory until Python's next full collection."""
    return _collected(_run(runner.Runner(), wl, seed, extra, **kw))


def _fresh_prompt(p, ids):
    return _collected(runner.Runner().run(p, ids))


def _collected(result):
    gc.collect()
    return result


def _same(host, a, b):
    """The same result: bit for bit on the CPU. On a GPU, a run in a fresh executor can get
    other convolution and GEMM algorithms than its reference (the libraries choose by the free
    memory and workspace they find), so there the bound is 60 dB latent PSNR, far above any
    lossy mode's and far below what a wrong weight or a skipped step gives."""
    if host.cpu:
        assert torch.equal(a.latent, b.latent), runner.psnr(a.latent, b.latent)
    else:
        assert runner.psnr(a.latent, b.latent) >= 60.0, runner.psnr(a.latent, b.latent)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _cn(tiny_models):
    import comfy.controlnet

    return comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))


def _model(tiny_models):
    import comfy.sd

    model, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(tiny_models["sd15-tiny"]), output_vae=False, output_clip=False
    )
    return model


def _sdxl_width_controlnet():
    """A stand-in ControlNet whose cross-attention expects SDXL's 2048-wide text conditioning."""
    net = torch.nn.Module()
    net.block = torch.nn.Module()
    net.block.attn2 = torch.nn.Module()
    net.block.attn2.to_k = torch.nn.Linear(2048, 8)
    return types.SimpleNamespace(control_model=net, previous_controlnet=None)


def _node_of(p: dict, class_type: str) -> str:
    (nid,) = [k for k, v in p.items() if v["class_type"] == class_type]
    return nid


# ---------------------------------------------------------------------------------------------
# 1. Bad input


def _rgba_hint(p, ids):
    """The hint through Join Image with Alpha (the Load Image mask as alpha): a 4-channel
    IMAGE, as a user gets it from an RGBA picture."""
    nid = str(max(int(k) for k in p) + 1)
    hint = ids["hint_0"]
    p[nid] = {
        "class_type": "JoinImageWithAlpha",
        "inputs": {"image": [hint, 0], "alpha": [hint, 1]},
    }
    p[ids["apply_0"]]["inputs"]["image"] = [nid, 0]


def test_rgba_hint_is_refused_at_the_apply_node(host, tiny_models):
    """Stock ComfyUI accepts the RGBA hint and fails inside the sampler with a convolution
    shape error; the Fused apply refuses it at its own node, saying what to do."""
    r = runner.Runner()
    with pytest.raises(runner.WorkflowFailed) as stock:
        _run(r, T1, 1, _rgba_hint)
    p, ids = wf.build_prompt(T1, 1, ["x"], None)
    assert f"node {ids['sampler']} (KSampler) failed" in str(stock.value)
    with pytest.raises(runner.WorkflowFailed) as ours:
        _run(r, T1, 1, _chain(VARIANTS["fused"], _rgba_hint))
    msg = str(ours.value)
    assert f"node {ids['apply_0']} (CNA_ControlNetApplyFused) failed" in msg
    assert "NodeInputError: Apply ControlNet (Fused): input 'image' has 4 channels" in msg
    assert "Pass an RGB image" in msg


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(image=torch.full((1, 64, 64, 3), float("inf"))), "'image' contains NaN or infinite"),
        (dict(image=-torch.full((1, 64, 64, 3), float("inf"))), "'image' contains NaN or infinite"),
        (dict(image=torch.rand(0, 64, 64, 3)), "'image' is empty"),
        (dict(image=torch.rand(1, 64, 0, 3)), "'image' is empty"),
        (dict(image=torch.rand(1, 64, 64, 1)), "'image' has 1 channels"),
        (dict(image=[[0.5]]), "'image' must be an IMAGE batch"),
        (dict(strength=-0.5), "'strength' is -0.5, outside 0–10"),
        (dict(strength=float("nan")), "'strength' is nan"),
        (dict(end_percent=1.5), "'end_percent' is 1.5, outside 0–1"),
    ],
    ids=["inf", "-inf", "batch0", "width0", "1ch", "list", "strength<0", "strength-nan", "end>1"],
)
def test_fused_more_bad_values(host, tiny_models, bad, match):
    pack = _pack(host)
    args = dict(
        positive=[[torch.zeros(1, 77, 768), {}]],
        negative=[[torch.zeros(1, 77, 768), {}]],
        control_net=_cn(tiny_models),
        image=torch.rand(1, 64, 64, 3),
        strength=1.0,
        start_percent=0.0,
        end_percent=1.0,
    )
    args.update(bad)
    cls = pack.nodes.nodes_fused_apply.ControlNetApplyFused
    with pytest.raises(pack.errors.NodeInputError, match=match) as e:
        cls.execute(**args)
    assert str(e.value).startswith("Apply ControlNet (Fused): input '") and e.value.fix


@pytest.mark.parametrize(
    "bad, name",
    [
        (dict(every_n=0), "every_n"),
        (dict(every_n=2.5), "every_n"),  # not a whole number
        (dict(max_reuse=-1), "max_reuse"),
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold=float("nan")), "threshold"),
        (dict(reuse_start=1.5), "reuse_start"),
        (dict(reuse_start=0.8, reuse_end=0.2), "reuse_start"),
        (dict(mode="sometimes"), "mode"),
        (dict(storage="int4"), "storage"),
    ],
)
def test_feature_cache_linked_values_get_a_named_error(host, tiny_models, bad, name):
    """Values from links skip ComfyUI's widget range check: the node refuses them itself, by
    name, instead of a bare ValueError from its configuration."""
    pack = _pack(host)
    cls = pack.nodes.nodes_feature_cache.ControlNetFeatureCache
    with pytest.raises(pack.errors.NodeInputError) as e:
        cls.execute(_cn(tiny_models), **bad)
    assert str(e.value).startswith(f"ControlNet Feature Cache: input '{name}'"), str(e.value)
    assert e.value.fix


def test_feature_cache_widget_values_are_refused_before_the_run(host, tiny_models):
    r = runner.Runner()
    bad = _feature_cache(mode="every_n", reuse_start=0.9, reuse_end=0.1)
    with pytest.raises(runner.WorkflowFailed, match="does not validate") as e:
        _run(r, T1, 2, bad)
    assert "reuse_start (0.9) is after reuse_end (0.1)" in str(e.value)


def test_feature_cache_passes_unsupported_kinds_through_with_a_note(host, tiny_models, caplog):
    import comfy.controlnet

    pack = _pack(host)
    cn = _cn(tiny_models)

    class OtherControl(comfy.controlnet.ControlNet):  # stands in for T2I-Adapter, Union, ...
        pass

    other = OtherControl(None)
    other.control_model, other.control_model_wrapped = cn.control_model, cn.control_model_wrapped
    cn.copy_to(other)
    cls = pack.nodes.nodes_feature_cache.ControlNetFeatureCache
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        out = cls.execute(other).result[0]
    assert out is other
    assert any("OtherControl" in r.message and "not cached" in r.message for r in caplog.records)
    assert type(cls.execute(cn).result[0]).__name__ == "CachedControlNet"


def test_memory_pool_refuses_a_controlnet_of_another_family(host, tiny_models):
    pack = _pack(host)
    cls = pack.nodes.nodes_memory_pool.ControlNetMemoryPool
    model = _model(tiny_models)
    with pytest.raises(pack.errors.NodeInputError) as e:
        cls.execute(model, _sdxl_width_controlnet())
    msg = str(e.value)
    assert msg.startswith("ControlNet Memory Pool: input 'control_net' is a SDXL ControlNet")
    assert "'model' is a SD1.5 model" in msg and "model family" in msg
    m, c = cls.execute(model, _cn(tiny_models), "as loaded", "as loaded").result  # same family
    assert m is not model and c is not None


def test_memory_pool_refuses_an_unknown_weight_mode(host, tiny_models):
    pack = _pack(host)
    cls = pack.nodes.nodes_memory_pool.ControlNetMemoryPool
    with pytest.raises(pack.errors.NodeInputError, match="input 'unet_weights' is 'int4'"):
        cls.execute(_model(tiny_models), None, unet_weights="int4")


def test_memory_pool_passes_unsupported_kinds_through_with_a_note(host, tiny_models, caplog):
    import comfy.controlnet

    pack = _pack(host)
    mp = pack.nodes.memory_pool
    cn = _cn(tiny_models)
    lora = comfy.controlnet.ControlLora({})
    cn.copy_to(lora)
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        _, out = mp.apply_memory_pool(_model(tiny_models), lora, mp.PoolOptions())
    assert out is lora
    assert any("ControlLora" in r.message and "as loaded" in r.message for r in caplog.records)


@pytest.mark.parametrize("value", [0, 65, 2.5])
def test_max_graphs_out_of_range_gets_a_named_error(host, tiny_models, value):
    """0 would otherwise fail inside the first sampling step, with a bare ValueError."""
    pack = _pack(host)
    ng = pack.nodes.nodes_cuda_graph
    model = _model(tiny_models)
    with pytest.raises(pack.errors.NodeInputError, match="CUDA Graph: input 'max_graphs'"):
        ng.CUDAGraphModel.execute(model, max_graphs=value)
    cond = [[torch.zeros(1, 77, 768), {}]]
    with pytest.raises(
        pack.errors.NodeInputError, match=r"KSampler \(CUDA Graph\): input 'max_graphs'"
    ):
        ng.KSamplerCUDAGraph.execute(
            model, 0, 1, 7.0, "euler", "normal", cond, cond, {}, max_graphs=value
        )


def test_ksampler_graph_refuses_a_controlnet_of_another_family(host, tiny_models):
    pack = _pack(host)
    ng = pack.nodes.nodes_cuda_graph
    model = _model(tiny_models)
    ok = [[torch.zeros(1, 77, 768), {}]]
    bad = [[torch.zeros(1, 77, 768), {"control": _sdxl_width_controlnet()}]]
    with pytest.raises(pack.errors.NodeInputError) as e:
        ng.KSamplerCUDAGraph.execute(model, 0, 1, 7.0, "euler", "normal", ok, bad, {})
    msg = str(e.value)
    assert msg.startswith("KSampler (CUDA Graph): input 'negative' carries a SDXL ControlNet")
    assert "'model' is a SD1.5 model" in msg
    ng.check_control_family("x", model, positive=[[ok[0][0], {"control": _cn(tiny_models)}]])


@pytest.mark.parametrize("kind", ["truncated", "garbage_header", "not_a_controlnet"])
def test_broken_controlnet_file_stops_at_the_stock_loader(host, tiny_models, kind):
    """A broken file never reaches our nodes: stock Load ControlNet Model fails first. (With
    safetensors >= 0.6 its error for a truncated file is the library's own 'Error while
    deserializing header: incomplete metadata...', without ComfyUI's hint: ComfyUI looks for
    the older wording. Documented in the report of issue #9; nothing our nodes can catch.)"""
    src = tiny_models["sd15-tiny-cn-a"]
    data = src.read_bytes()
    name = f"cna_broken_{kind}_{uuid.uuid4().hex[:8]}.safetensors"
    path = src.parent / name
    # the safetensors library's words, or those of ComfyUI 0.33's own loader (used under
    # DynamicVRAM), which names the file and says it is corrupt
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
        want = ("deserializing header", "The safetensors file is corrupt/incomplete")
    elif kind == "garbage_header":
        path.write_bytes(b"\xff" * 8 + data[8:])
        want = ("deserializing header", "The safetensors file is corrupt or invalid")
    else:
        import safetensors.torch

        safetensors.torch.save_file({"a": torch.zeros(3)}, str(path))
        want = ("does not contain a valid controlnet model",)
    try:

        def use_broken(p, ids):
            p[ids["cn_0"]]["inputs"]["control_net_name"] = name
            VARIANTS["fused"](p, ids)

        with pytest.raises(runner.WorkflowFailed) as e:
            _fresh(T1, 3, use_broken)
        _, ids = wf.build_prompt(T1, 3, ["x"], None)
        assert f"node {ids['cn_0']} (ControlNetLoader) failed" in str(e.value)
        assert any(w in str(e.value) for w in want), str(e.value)
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.captures
def test_unsupported_control_kind_runs_eager_with_the_reason(
    host, tiny_models, monkeypatch, caplog
):
    """Control objects the graph path does not know run eager (stock), saying why."""
    import comfy.controlnet

    cg = _pack(host).nodes.cuda_graph
    supported = cg._supported_control_types()
    narrowed = tuple(t for t in supported if t is not comfy.controlnet.ControlNet)
    monkeypatch.setattr(cg, "_supported_control_types", lambda: narrowed)
    r = runner.Runner()
    stock = _run(r, T1, 4)
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        graph = _run(r, T1, 4, GRAPH)
    _same(host, stock, graph)
    g = badges.graph_counts(graph)
    assert g["captures"] == 0 and g["eager"] >= T1.steps, g
    assert any(
        "control type ControlNet is not supported by the graph path" in rec.message
        for rec in caplog.records
    )


# ---------------------------------------------------------------------------------------------
# 2. Faults


@pytest.mark.captures
@pytest.mark.parametrize("where", ["capture", "static_buffers"])
def test_out_of_memory_in_capture_releases_graphs_and_runs_eager(
    host, tiny_models, monkeypatch, caplog, where
):
    """Out of memory while capturing a new signature (or allocating its static buffers): the
    run completes eager with the stock result, this model's other graphs are dropped and the
    allocator's cache emptied, the failed capture's tensors are freed before the eager step
    runs, and the reason reaches the log and the node's badge. Other signatures capture again
    on later runs."""
    import comfy.ldm.modules.diffusionmodules.openaimodel as oa
    import comfy.model_management as mm

    pack = _pack(host)
    cg = pack.nodes.cuda_graph
    small, big = T1, T1.with_(width=96, height=80)
    r = runner.Runner()
    stock_small, stock_big = _run(r, small, 5), _run(r, big, 5)
    _run(r, small, 5, GRAPH)  # one graph (small) captured, to be released

    seen: dict = {"caches": [], "refs": [], "alive_at_eager": []}
    orig_forward = oa.UNetModel._forward

    def forward(self, x, *a, **k):
        caps = [s.cache for s in cg._STATES.values() if s.cache.capturing]
        if caps:
            seen["caches"] += caps
            seen["refs"].append(weakref.ref(x))
            raise OOM("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if seen["refs"] and len(seen["alive_at_eager"]) < 1:
            gc.collect()
            seen["alive_at_eager"].append(seen["refs"][0]() is not None)
        return orig_forward(self, x, *a, **k)

    def capture(self, *a, **k):
        seen["caches"].append(self)
        raise OOM("CUDA out of memory. Tried to allocate 512.00 MiB (injected)")

    if where == "capture":
        monkeypatch.setattr(oa.UNetModel, "_forward", forward)
    else:
        monkeypatch.setattr(pack.graphs.GraphCache, "capture", capture)
    emptied = []
    orig_empty = mm.soft_empty_cache

    def soft_empty_cache(*a, **k):
        emptied.append(1)
        return orig_empty(*a, **k)

    monkeypatch.setattr(mm, "soft_empty_cache", soft_empty_cache)

    before = badges.model_graph_counts(r, CKPT)  # this runner's model: alive all along
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        p, ids = _prompt(big, 5, GRAPH)
        got = r.run(p, ids)
    _same(host, stock_big, got)
    after = badges.model_graph_counts(r, CKPT)
    d = {k: after[k] - before[k] for k in before}
    assert d["failed"] == 1 and d["captures"] == 0 and d["released"] >= 1, d
    cache = seen["caches"][0]
    assert not cache.entries  # the small signature's graph went too
    assert any("OutOfMemoryError: CUDA out of memory" in v for v in cache.failed.values())
    assert emptied
    if where == "capture":
        assert seen["alive_at_eager"] == [False]
    warned = [m.message for m in caplog.records if "CUDA graph disabled" in m.message]
    assert warned and "OutOfMemoryError" in warned[0]
    badge = _pack(host).nodes.status.LAST[_node_of(p, "CNA_CUDAGraph")]["data"]
    assert any("OutOfMemoryError" in x for x in badge.get("eager_reasons", [])), badge

    monkeypatch.undo()  # memory is back: the small signature captures and replays again
    if host.cpu:
        monkeypatch.setenv("CNA_GRAPH_BACKEND", "emulate")
    again = _run(r, small, 5, GRAPH)
    _same(host, stock_small, again)
    if not (where == "capture" and cache.async_allocator):  # PyTorch cannot capture again
        assert badges.graph_counts(again)["captures"] == 1  # after that under cudaMallocAsync


def test_out_of_memory_in_a_step_beside_graphs_gives_their_memory_back_and_runs_again(
    host, tiny_models, monkeypatch, caplog
):
    """A step that runs out of memory while graphs of the pack hold memory (their pools, which
    ComfyUI's memory manager cannot see): the graphs are dropped, the allocator's cache handed
    back, and the step runs again, so the prompt completes with the stock result instead of
    failing. With nothing of ours to give back, the error is ComfyUI's as before."""
    import comfy.ldm.modules.diffusionmodules.openaimodel as oa

    cg = _pack(host).nodes.cuda_graph
    small, big = T1, T1.with_(width=96, height=80)
    r = runner.Runner()
    stock_big = _run(r, big, 5)
    _run(r, small, 5, GRAPH)  # one graph (small) captured, to be given back
    assert any(st.cache.entries for st in cg._STATES.values())

    raised = []
    orig_forward = oa.UNetModel._forward

    def forward(self, x, *a, **k):
        capturing = any(st.cache.capturing for st in cg._STATES.values())
        if not raised and not capturing:  # the run's first step, eager
            raised.append(1)
            raise OOM("CUDA out of memory. Tried to allocate 40.00 MiB (injected)")
        return orig_forward(self, x, *a, **k)

    def released() -> int:  # every model's: under DynamicVRAM the graphs are a copy's
        return sum(st.stats["released"] for st in cg._STATES.values())

    monkeypatch.setattr(oa.UNetModel, "_forward", forward)
    before = released()
    with caplog.at_level("INFO", logger="ControlNetAccelerator"):
        got = _run(r, big, 5, GRAPH)
    _same(host, stock_big, got)
    assert raised == [1]
    assert released() - before >= 1
    assert any("out of memory in a step" in m.message for m in caplog.records)
    assert badges.graph_counts(got)["captures"] == 1  # the new signature still captured

    # nothing of ours holds memory now: the same fault is ComfyUI's error, as without the pack
    for st in cg._STATES.values():
        st.release_all("test")
    raised.clear()
    p, ids = _prompt(big, 6, GRAPH)
    with pytest.raises(runner.WorkflowFailed, match="out of memory"):
        r.run(p, ids)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_out_of_memory_in_the_feature_cache_runs_uncached(
    host, tiny_models, monkeypatch, caplog, graph
):
    """Out of memory allocating the cache's stores: the run completes with the ControlNet
    computed on every step (the uncached result), the stores are freed, the reason is logged
    and on the node's badge; the next run caches again."""
    pack = _pack(host)
    fc, mem = pack.nodes.feature_cache, pack.memory.feature_cache
    wl = T1.with_(steps=8)
    extra_g = [GRAPH] if graph else []
    r = runner.Runner()
    stock = _run(r, wl, 6)
    uncached = _fresh(wl, 6, _chain(NEVER, *extra_g))

    def put(self, out):
        raise OOM("CUDA out of memory. Tried to allocate 64.00 MiB (injected)")

    orig_put = mem.ResidualStore.put
    monkeypatch.setattr(mem.ResidualStore, "put", put)
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        p, ids = _prompt(wl, 6, _chain(EVERY2, *extra_g))
        got = badges.run(r, p, ids)
    _same(host, got, uncached)
    if host.cpu:
        assert _rel(got.latent, stock.latent) <= 1e-5
    calls = _cache_calls(got)
    assert calls["reused"] == 0 and calls["computed"] >= 1, calls  # it ran, and never reused
    warned = [m.message for m in caplog.records if "Feature Cache: out of memory" in m.message]
    assert len(warned) == 1, warned
    gc.collect()
    nets = [o for o in gc.get_objects() if type(o) is fc.CachedControlNet]
    assert sum(n.cache_bytes() for n in nets) == 0
    badge = pack.nodes.status.LAST[_node_of(p, "CNA_ControlNetFeatureCache")]["data"]
    assert "out of memory" in badge.get("off_reason", ""), badge

    monkeypatch.setattr(mem.ResidualStore, "put", orig_put)
    # a new seed: the sampler runs again on the same ControlNet objects (ComfyUI keeps the
    # loaders' and applies' outputs), and the cache is back on
    again = _run(r, wl, 16, _chain(EVERY2, *extra_g))
    assert _cache_calls(again)["reused"] > 0
    want = _fresh(wl, 16, _chain(EVERY2, *extra_g))
    _same(host, again, want)


def test_out_of_memory_while_compressing_keeps_weights_as_loaded(
    host, tiny_models, monkeypatch, caplog
):
    """Out of memory midway through the INT8 copies: the weights stay as loaded (the stock
    result exactly), the copies made so far are dropped, the reason is logged and on the badge."""
    pack = _pack(host)
    mp, wc = pack.nodes.memory_pool, pack.memory.weight_compress
    stock = _fresh(T1, 7)
    calls = {"n": 0}
    orig = wc.compress

    def compress(*a, **k):
        calls["n"] += 1
        if calls["n"] >= 3:
            raise OOM("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return orig(*a, **k)

    monkeypatch.setattr(wc, "compress", compress)
    gc.collect()
    n_cached = len(mp._COMPRESSED)
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        p, ids = _prompt(T1, 7, VARIANTS["pool_int8"])
        got = _fresh_prompt(p, ids)
    _same(host, got, stock)
    assert calls["n"] >= 3
    gc.collect()
    assert len(mp._COMPRESSED) == n_cached  # the two copies made before the failure are gone
    warned = [m.message for m in caplog.records if "out of memory while compressing" in m.message]
    assert any("diffusion model" in w for w in warned) and any("ControlNet" in w for w in warned)
    badge = pack.nodes.status.LAST[_node_of(p, "CNA_ControlNetMemoryPool")]["data"]
    assert set(badge.get("int8_failed", {})) == {"diffusion model", "ControlNet"}, badge


def test_out_of_memory_for_one_layer_on_the_gpu_quantizes_it_on_the_cpu(
    host, tiny_models, monkeypatch
):
    """The Memory Pool quantizes unloaded weights on the GPU, one layer at a time; when even
    one layer does not fit there, that layer is quantized where its weight lies (the CPU) and
    the run is the one that quantizes that same layer there (not weights left as loaded). The
    reference moves that one layer's quantizing to the CPU without a fault: on a GPU the two
    devices' int8 may differ by one step on rounding boundaries, so a reference quantized
    wholly on the GPU is not the same run."""
    pack = _pack(host)
    mp, wc = pack.nodes.memory_pool, pack.memory.weight_compress
    orig_on_device, orig = mp._on_compute_device, wc.compress
    where = {"n": 0}

    def second_layer_stays(patcher, w):
        where["n"] += 1
        return w if where["n"] == 2 else orig_on_device(patcher, w)

    monkeypatch.setattr(mp, "_on_compute_device", second_layer_stays)
    mp._COMPRESSED.clear()
    p, ids = _prompt(T1, 7, VARIANTS["pool_int8"])
    ref = _fresh_prompt(p, ids)
    assert where["n"] > 3
    monkeypatch.setattr(mp, "_on_compute_device", orig_on_device)
    calls = {"n": 0}

    def compress(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OOM("CUDA out of memory. Tried to allocate 20.00 MiB (injected)")
        return orig(*a, **k)

    monkeypatch.setattr(wc, "compress", compress)
    mp._COMPRESSED.clear()  # compress again, now with the fault
    p, ids = _prompt(T1, 7, VARIANTS["pool_int8"])
    got = _fresh_prompt(p, ids)
    assert calls["n"] > 3  # the fault hit one layer, the rest went on
    _same(host, got, ref)
    badge = pack.nodes.status.LAST[_node_of(p, "CNA_ControlNetMemoryPool")]["data"]
    assert not badge.get("int8_failed"), badge


def _interrupt_inside_sampling(at: int, seen: list):
    """What ComfyUI's server does when the user presses Cancel: its progress hook raises the
    interrupt inside the sampler's step callback (main.py, hijack_progress). The harness has no
    server, so without this the interrupt would land only at the next node."""
    import comfy.model_management as mm

    def on_step(step):
        seen.append(step)
        if step == at:
            mm.interrupt_current_processing(True)
            mm.throw_exception_if_processing_interrupted()

    return on_step


@pytest.mark.parametrize(
    "variant", ["fused+graph", "cache_every2+graph", "pool_int8_offload+graph", "stack_all"]
)
def test_interrupt_mid_sampling_then_the_next_run_is_clean(host, tiny_models, variant):
    """Interrupted at step 3 of 8: the same prompt run again (ComfyUI reuses the loaders' and
    applies' outputs, so the same ControlNet objects) gives what a fresh process gives, and a
    stock run afterwards gives the stock result."""
    wl = T2.with_(steps=8)
    want = _fresh(wl, 8, VARIANTS[variant])
    want_stock = _fresh(wl, 8)
    r = runner.Runner()
    seen: list = []
    with pytest.raises(runner.WorkflowFailed, match="interrupted"):
        _run(r, wl, 8, VARIANTS[variant], on_step=_interrupt_inside_sampling(3, seen))
    assert seen == [1, 2, 3]  # it stopped inside sampling
    again = _run(r, wl, 8, VARIANTS[variant])
    _same(host, want, again)
    if not host.dynamic_vram:  # and in graphs (eager would give the same result)
        assert badges.graph_counts(again)["replays"] > 0, badges.graph_counts(again)
    _same(host, want_stock, _run(r, wl, 8))


@pytest.mark.captures
@pytest.mark.parametrize("variant", ["cache_every2+graph", "stack_all"])
def test_models_unloaded_between_runs_of_every_node(host, tiny_models, variant):
    """Everything unloaded between two runs of one executor (the same ControlNet objects and
    Feature Cache buffers, graphs released with the model): the second run equals a fresh
    process's."""
    import comfy.model_management as mm

    r = runner.Runner()
    _run(r, T2, 9, VARIANTS[variant])
    released = badges.model_graph_counts(r, CKPT)["released"]
    mm.unload_all_models()
    mm.soft_empty_cache()
    assert badges.model_graph_counts(r, CKPT)["released"] > released
    # another seed, or ComfyUI would answer from its output cache without sampling
    got = _run(r, T2, 19, VARIANTS[variant])
    _same(host, _fresh(T2, 19, VARIANTS[variant]), got)
    assert badges.graph_counts(got)["replays"] > 0, badges.graph_counts(got)  # graphs again


def test_two_workflows_alternating_give_their_own_results(host, tiny_models):
    """A cached + fused + graph workflow with one ControlNet and an everything-on workflow with
    two take turns on the same checkpoint and network: each gives, every time, what it gives
    alone in a fresh process."""
    a = (T1, VARIANTS["cache_every2+graph"])
    b = (T2, VARIANTS["stack_all"])
    want = {k: _fresh(wl, 10, v) for k, (wl, v) in (("a", a), ("b", b))}
    r = runner.Runner()
    for _ in range(2):
        for k, (wl, v) in (("a", a), ("b", b)):
            _same(host, want[k], _run(r, wl, 10, v))
