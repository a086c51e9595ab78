# SPDX-License-Identifier: GPL-3.0-or-later
"""Compiled mode of the CUDA Graph nodes against stock ComfyUI, on the same random weights and
seeds.

On the CPU the graphs are emulated and the compile backend is ``aot_eager`` (dynamo traces the
real ComfyUI UNet and ControlNet and runs the traced graphs; no code is generated, which would
take minutes per network on a small CPU): this checks the glue, the tracing and the guards. On a
GPU (``CNA_TEST_GPU=1``) the backend is inductor and the compiled kernels are captured in real
CUDA graphs.

Tolerance: latent PSNR ≥ 45 dB against stock after the run, the pack's "exact" bar. Compiled
code fuses ops and keeps fp32 accumulators where eager rounds to fp16 in between, so it is not
bit-identical; one ControlNet more or less, or a changed strength, moves the latent by less than
30 dB, so 45 dB cannot hide a wrong input.
"""

from __future__ import annotations

import inspect
import logging
import sys

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import _chain, _insert_model_node

pytestmark = [pytest.mark.host, pytest.mark.captures, pytest.mark.usefixtures("graph_backend")]
MIN_PSNR = 45.0


def _async_allocator(host) -> bool:
    return not host.cpu and torch.cuda.get_allocator_backend() == "cudaMallocAsync"


@pytest.fixture
def native(host):
    if _async_allocator(host):
        pytest.skip(
            "compiled mode needs PyTorch's native allocator on a GPU; under cudaMallocAsync "
            "test_cuda_malloc_async_keeps_the_eager_graphs_and_says_why runs instead"
        )
    return host


@pytest.fixture(autouse=True)
def compile_backend(host, monkeypatch):
    if host.cpu:
        monkeypatch.setenv("CNA_COMPILE_BACKEND", "aot_eager")
        # ComfyUI's CPU attention (sub-quadratic) asks the OS for free memory inside the
        # forward, which dynamo cannot trace; on a GPU PyTorch's attention runs. Stock and
        # compiled runs of these tests both use it.
        import comfy.ldm.modules.attention as attention

        monkeypatch.setattr(attention, "optimized_attention", attention.attention_pytorch)
        monkeypatch.setattr(attention, "optimized_attention_masked", attention.attention_pytorch)
    return "aot_eager" if host.cpu else "inductor"


def _status(host):
    return sys.modules[host.pack_module_name].nodes.status


def _run(r, wl, seed, extra=None):
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, seed, hints, extra)
    return r.run(p, ids), p


def _graph(**inputs):
    return _insert_model_node(
        "CNA_CUDAGraph", **{"enabled": True, "max_graphs": 8, "verify": False, **inputs}
    )


def _badge(host, p, class_type="CNA_CUDAGraph") -> dict:
    node = next(k for k, v in p.items() if v["class_type"] == class_type)
    return _status(host).LAST[node]["data"]


def _compiled_run_matches_stock(host, seed: int, **inputs) -> None:
    """T1, 4 steps, compiled mode (with the node's ``inputs``) against stock on ``seed``: within
    the exact bar, and no input signature fell back to eager."""
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4)
    stock, _ = _run(r, wl, seed)
    got, p = _run(r, wl, seed, _graph(compile="inductor", **inputs))
    assert runner.psnr(stock.latent, got.latent) >= MIN_PSNR, runner.psnr(stock.latent, got.latent)
    assert _badge(host, p)["compiled"]["failed_signatures"] == 0


def test_compiled_graph_matches_stock_and_values_cost_no_compile(host, native, tiny_models):
    """One ControlNet, 6 steps: the compiled graph path matches stock; the first run compiles
    the UNet and the ControlNet once each, and a second run with another strength and seed
    compiles nothing and still matches stock."""
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=6)
    stock, _ = _run(r, wl, 5)
    got, p = _run(r, wl, 5, _graph(compile="inductor"))
    assert runner.psnr(stock.latent, got.latent) >= MIN_PSNR, runner.psnr(stock.latent, got.latent)
    data = _badge(host, p)
    comp = data["compiled"]
    assert comp["compiles"] == 2 and comp["failed_signatures"] == 0, comp
    assert 0 < comp["backend_s"] <= comp["compile_s"], comp  # the compile's time, split
    assert data["captures"] >= 1 and data["replays"] >= 4, data

    wl2 = wl.with_(strength=0.55)
    stock2, _ = _run(r, wl2, 9)
    got2, p2 = _run(r, wl2, 9, _graph(compile="inductor"))
    assert runner.psnr(stock2.latent, got2.latent) >= MIN_PSNR
    data2 = _badge(host, p2)
    assert data2["compiled"]["compiles"] == 0, data2["compiled"]
    assert data2["captures"] == 0 and data2["replays"] >= 5, data2
    # the strength really reached the graph: the two runs differ far beyond the tolerance
    assert runner.psnr(got.latent, got2.latent) < 30


def test_compiled_runs_on_channels_last_weights_and_puts_them_back(
    host, native, tiny_models, monkeypatch
):
    """Compiled mode hands inductor channels-last convolution weights (else its code permutes
    every weight at every call) for the length of the run, without the node's channels_last
    input, and the weights are ComfyUI's again after it: same storage, values and layout."""
    import comfy.model_management
    import folder_paths

    if host.cpu:
        cl = sys.modules[host.pack_module_name].nodes.channels_last
        monkeypatch.setattr(cl, "DEVICES", ("cuda", "cpu"))

    def convs():
        return [
            m.weight
            for lm in comfy.model_management.current_loaded_models
            if lm.model is not None
            for m in lm.model.model.modules()
            if isinstance(m, torch.nn.Conv2d)
        ]

    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4)
    stock, _ = _run(r, wl, 12)
    before = [(w, w.data_ptr(), float(w.double().sum())) for w in convs()]
    assert before and all(w.is_contiguous() for w, *_ in before)
    seen = []

    def on_step(step):  # 1x1 kernels are in both layouts at once: count the others
        seen.append(
            [
                w.is_contiguous(memory_format=torch.channels_last) and not w.is_contiguous()
                for w in convs()
                if w.shape[-2:] != (1, 1)
            ]
        )

    hints = wf.write_hint_images(folder_paths.get_input_directory(), wl)
    p, ids = wf.build_prompt(wl, 12, hints, _graph(compile="inductor"))
    got = r.run(p, ids, on_step=on_step)
    assert runner.psnr(stock.latent, got.latent) >= MIN_PSNR
    assert seen and all(s and all(s) for s in seen), seen
    for w, ptr, total in before:
        assert w.is_contiguous() and w.data_ptr() == ptr and float(w.double().sum()) == total


def test_geglus_of_comfyuis_networks_take_the_pack_kernel_and_match_stock(
    host, native, tiny_models, monkeypatch
):
    """The GEGLU rewrite on ComfyUI's own UNet and ControlNet (forced on: on the CPU the Triton
    kernel does not serve, and the op runs PyTorch's path there): it finds the feed-forward
    projection and GEGLU of every transformer block in both networks' traced graphs, as
    ComfyUI's ``GEGLU`` writes them on either version, and the run still matches stock."""
    import dataclasses

    pack = sys.modules[host.pack_module_name]
    step, fx = pack.nodes.compiled_step, pack.kernels.fx_rewrites
    seen = []

    @dataclasses.dataclass(frozen=True)
    class Counting(fx.GegluRewrite):
        def __call__(self, gm):
            seen.append(self.rewrite(gm))
            return None

    opts = dataclasses.replace(step.CHOICES["inductor"], graph_passes=(Counting(force=True),))
    monkeypatch.setitem(step.CHOICES, "inductor", opts)
    monkeypatch.setenv(fx.GEGLU_ENV, "1")  # the rewrite is opt-in; off, compiled mode leaves it out
    _compiled_run_matches_stock(host, 22)
    import comfy.controlnet
    import comfy.sd

    unet, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(tiny_models["sd15-tiny"]), output_vae=False, output_clip=False
    )
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    geglus = sum(
        type(m).__name__ == "GEGLU"
        for net in (unet.model.diffusion_model, cn.control_model)
        for m in net.modules()
    )
    assert geglus >= 2 and len(seen) >= 2, (geglus, seen)  # the UNet's graph and the ControlNet's
    assert sum(seen) == geglus, (geglus, seen)  # every one, once


def test_attentions_of_comfyuis_networks_run_the_backend_measured_fastest(
    host, native, tiny_models, monkeypatch
):
    """The attention-backend choice, as it runs by default, on ComfyUI's own UNet and
    ControlNet. ComfyUI runs attention on NVIDIA GPUs inside ``sdpa_kernel(priority,
    set_priority=True)``; on the CPU it does not, and 0.33 runs attentions of fewer than 128K
    elements (all of the tiny models') without it, so there the test puts that wrapper (with
    0.33's flash-first priority) in ComfyUI's place. The pass finds the attentions of the
    UNet's and the ControlNet's traced graphs, moves each to the backend its timer says is
    fastest (cuDNN here; on a GPU the real timer runs, and on 0.3.64's own cuDNN-first order
    nothing moves), and the run still matches stock."""
    import dataclasses

    import comfy.ops

    pack = sys.modules[host.pack_module_name]
    step, ac = pack.nodes.compiled_step, pack.kernels.attention_choice
    if host.cpu or pack.nodes.compat.version_tuple(host.version) >= (0, 33):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        order = [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]

        def gpu_style(q, k, v, *args, **kwargs):
            with sdpa_kernel(order, set_priority=True):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)

        monkeypatch.setattr(comfy.ops, "scaled_dot_product_attention", gpu_style)
    if host.cpu:
        ms = {"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.5, "EFFICIENT_ATTENTION": 2.0}
        timer = lambda site, backend: ms[backend]  # noqa: E731
    else:
        timer = ac.time_backend
    seen = []

    @dataclasses.dataclass(eq=False)
    class Counting(ac.AttentionBackendChoice):
        def __call__(self, gm):
            found = len(ac.sites(gm))
            seen.append((found, self.rewrite(gm)))
            return None

    counting = Counting(timer=timer, force=host.cpu).only_first(ac.AUTO_FROM)
    monkeypatch.setattr(step, "ATTENTION_CHOICE_AUTO", counting)
    monkeypatch.delenv(ac.ENV, raising=False)  # the default: flash-first attentions
    _compiled_run_matches_stock(host, 23)
    # UNet and ControlNet; a region between graph breaks may hold no attention at all
    with_sites = [found for found, _ in seen if found]
    assert len(with_sites) >= 2 and all(found >= 2 for found in with_sites), seen
    if host.cpu:
        assert all(moved == {"CUDNN_ATTENTION": found} for found, moved in seen), seen


def test_positive_only_controlnet_runs_compiled_in_the_graph(host, native, tiny_models):
    """Apply ControlNet (Fused) on the positive half of the CFG batch only: the ControlNet sees
    half the batch and a hint prepared for it, whose encoding the graph reads; the UNet and the
    ControlNet without its encoder compile, nothing runs eager, and the result matches the same
    prompt without graphs."""
    from comfyui_controlnet_accelerator.harness.quick import _chain, _positive_only

    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=5)
    plain, _ = _run(r, wl, 14, _positive_only)
    got, p = _run(r, wl, 14, _chain(_positive_only, _graph(compile="inductor")))
    assert runner.psnr(plain.latent, got.latent) >= MIN_PSNR
    data = _badge(host, p)
    comp = data["compiled"]
    assert data["captures"] >= 1 and data["replays"] >= 3, data
    assert comp["compiles"] == 2 and comp["failed_signatures"] == 0, comp
    assert comp["eager_calls"] == 0, comp


def test_compiled_and_eager_graphs_of_one_model_do_not_share_graphs(host, native, tiny_models):
    """The same model through an eager and a compiled CUDA Graph node: each captures its own
    graph (the compiled one never replays eager kernels, nor the other way round)."""
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=4)
    _run(r, wl, 3, _graph())
    _, p = _run(r, wl, 3, _graph(compile="inductor"))
    assert _badge(host, p)["captures"] == 1


def test_model_from_torch_compile_model_is_captured_not_refused(host, native, tiny_models, caplog):
    """ComfyUI's TorchCompileModel before the CUDA Graph node: its compile runs inside the
    graphs (its wrapper is not used for the run) instead of making every step eager."""
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=5)
    stock, _ = _run(r, wl, 8)
    tcm = _insert_model_node("TorchCompileModel", backend="inductor")
    with caplog.at_level(logging.INFO):
        got, p = _run(r, wl, 8, _chain(tcm, _graph()))
    assert runner.psnr(stock.latent, got.latent) >= MIN_PSNR
    data = _badge(host, p)
    assert data["captures"] >= 1 and data["replays"] >= 3, data
    assert data["compiled"]["source"] == "TorchCompileModel", data["compiled"]
    assert not data.get("eager_reasons"), data
    assert any("TorchCompileModel" in rec.getMessage() for rec in caplog.records)


def test_ksampler_cuda_graph_compiled_matches_ksampler(host, native, tiny_models):
    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=5)
    stock, _ = _run(r, wl, 13)

    def ksampler(p: dict, ids: dict) -> None:
        s = p[ids["sampler"]]
        s["class_type"] = "CNA_KSamplerCUDAGraph"
        s["inputs"].update(enabled=True, max_graphs=8, verify=False, compile="inductor")

    got, p = _run(r, wl, 13, ksampler)
    assert runner.psnr(stock.latent, got.latent) >= MIN_PSNR
    data = _badge(host, p, "CNA_KSamplerCUDAGraph")
    assert data["compiled"]["failed_signatures"] == 0 and data["replays"] >= 3, data


def test_repeated_regions_compiled_once_match_stock(host, native, tiny_models, monkeypatch, caplog):
    """``CNA_COMPILE_DEDUP=1``: the UNet's and the ControlNet's repeated blocks are traced as
    calls of one region each; the run matches stock like the whole-graph compile."""
    monkeypatch.setenv("CNA_COMPILE_DEDUP", "1")
    with caplog.at_level(logging.INFO, logger="ControlNetAccelerator"):
        _compiled_run_matches_stock(host, 17)
    said = [r.getMessage() for r in caplog.records if "repeated regions compiled once" in r.message]
    assert said and any(not m.split(": ")[-1].startswith("0 repeated") for m in said), said


def _residuals_for(unet, x, t, ctx):
    """Random residuals of the shapes ComfyUI's UNet adds them at: the middle block's output,
    and each input block's output for the output blocks (popped last first, as ComfyUI's).
    ComfyUI runs a block's layers one by one, so the shapes are read at each block's last."""
    shapes: dict[str, list] = {"input": [], "middle": []}

    def keep(where):
        return lambda m, a, o: shapes[where].append(o.shape)

    hooks = [b[-1].register_forward_hook(keep("input")) for b in unet.input_blocks]
    hooks.append(unet.middle_block[-1].register_forward_hook(keep("middle")))
    try:
        with torch.no_grad():
            unet._forward(x, t, context=ctx, control=None, transformer_options={})
    finally:
        for h in hooks:
            h.remove()
    assert len(shapes["middle"]) == 1 and len(shapes["input"]) == len(unet.input_blocks)
    g = torch.Generator().manual_seed(3)
    rand = [torch.randn(s, generator=g).to(x) * 0.5 for s in [*shapes["middle"], *shapes["input"]]]
    return rand[:1], rand[1:]


def _tiny_unet_and_inputs(host, tiny_models):
    """ComfyUI's UNet of the tiny SD1.5 checkpoint on the test device, batch-2 inputs at 16x16,
    and random residuals of the shapes it adds them at (``_residuals_for``)."""
    import comfy.sd

    model, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(tiny_models["sd15-tiny"]), output_vae=False, output_clip=False
    )
    unet = model.model.diffusion_model.to("cpu" if host.cpu else "cuda")
    p0 = next(unet.parameters())
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 16, 16, generator=g).to(p0)
    t = torch.tensor([500.0, 700.0], device=p0.device)
    ctx = torch.randn(2, 77, 768, generator=g).to(p0)
    middle, output = _residuals_for(unet, x, t, ctx)
    return unet, x, t, ctx, middle, output


@pytest.mark.parametrize("nested", [False, True], ids=["enclosing-retraced", "nested-breaks"])
def test_unet_compiled_with_residuals_joined_on_use_waits_once_between_its_parts(
    host, native, tiny_models, compile_backend, nested
):
    """The ControlNets beside the UNet in compiled mode (``concurrent_controlnet``): the
    residual dict waits for their stream when the UNet first reads a residual. Compiled, that
    wait is a call dynamo does not trace: ComfyUI's UNet compiles in parts with the wait run
    between them, once per call, at the middle block's residual (not before the input blocks);
    a new dict of the same shapes runs the same compiled code; the output is the eager UNet's.
    The same with dynamo resuming in the frame of the break (``nested_breaks``)."""
    pack = sys.modules[host.pack_module_name]
    C, gd = pack.graphs.compiled, pack.nodes.graph_deferral
    if nested and not C.nested_breaks_available():
        pytest.skip("this torch has no nested_graph_breaks")
    unet, x, t, ctx, middle, output = _tiny_unet_and_inputs(host, tiny_models)
    waits: list = []

    def record(residuals):
        # where the compiled code stopped for the wait: the frame of ComfyUI's apply_control
        # that asked for a residual (the code between the compiled parts runs as Python)
        frame, at = inspect.currentframe(), None
        while frame is not None and at is None:
            if frame.f_code.co_name == "apply_control":
                at = frame.f_locals.get("name")
            frame = frame.f_back
        waits.append((residuals.event, at))

    def control(event):
        ctrl = {"input": [], "middle": list(middle), "output": list(output)}
        return gd._JoinOnUse(ctrl, event, C.untraced(record))

    with torch.no_grad():
        plain = {"input": [], "middle": list(middle), "output": list(output)}
        ref = unet._forward(x, t, context=ctx, control=plain, transformer_options={})
        bare = unet._forward(x, t, context=ctx, control=None, transformer_options={})
    convs: list[int] = []  # convolutions in each graph handed to the backend, in order

    def count_convs(gm):
        convs.append(
            sum(n.op == "call_function" and "conv" in str(n.target) for n in gm.graph.nodes)
        )

    opts = C.CompileOptions(
        backend=compile_backend, nested_breaks=nested, graph_passes=(count_convs,)
    )
    cm = C.CompiledModule(unet, "UNet", opts, method="_forward")
    with torch.no_grad():
        got = cm(x, t, context=ctx, control=control("e1"), transformer_options={})
        graphs = cm.graphs
        again = cm(x, t, context=ctx, control=control("e2"), transformer_options={})
    assert cm.compiles == 1 and not cm.failed and cm.eager_calls == 0, (cm.failed, cm.stats())
    assert graphs >= 2 and cm.graphs == graphs, (graphs, cm.graphs)  # parts; nothing recompiled
    # once per call, where the middle block's residual is read: the input blocks and the middle
    # block run before it, beside the ControlNets. Resumed in the nested frame, the wait is
    # called from compiled code, not from a Python frame of apply_control; the graphs on each
    # side of it say where it is.
    assert [e for e, _ in waits] == ["e1", "e2"], waits
    if not nested:
        assert [at for _, at in waits] == ["middle", "middle"], waits
    assert len(convs) == graphs and convs[0] > 0 and convs[-1] > 0, convs
    tol = C.PARITY_TOL[ref.dtype]  # relative L2: fused code keeps fp32 where eager rounds
    for out in (got, again):
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        assert err <= tol, (err, tol)
    assert ((ref.float() - bare.float()).norm() / ref.float().norm()).item() > 10 * tol


def test_unet_compiled_with_the_traced_join_is_one_graph_waiting_after_the_middle_block(
    host, native, tiny_models, compile_backend
):
    """Compiled mode's default join (``traced_join``): the wait for the ControlNets' stream is an
    op of the UNet's graph, so ComfyUI's UNet compiles as one graph, with no graph break; the
    op comes after every convolution of the input blocks and the middle block (where the first
    residual is read) and before the output blocks'; it makes the wait once per call; a new
    dict of the same shapes runs the same compiled code; the output is the eager UNet's."""
    from torch._dynamo.utils import counters

    pack = sys.modules[host.pack_module_name]
    C, gd, sj = pack.graphs.compiled, pack.nodes.graph_deferral, pack.graphs.stream_join
    unet, x, t, ctx, middle, output = _tiny_unet_and_inputs(host, tiny_models)

    def plain():
        return {"input": [], "middle": list(middle), "output": list(output)}

    with torch.no_grad():
        ref = unet._forward(x, t, context=ctx, control=plain(), transformer_options={})
    before_first_read = sum(
        isinstance(m, torch.nn.Conv2d)
        for blocks in (unet.input_blocks, unet.middle_block)
        for m in blocks.modules()
    )
    order: list[list[str]] = []  # per graph handed to the backend: its convolutions and the op

    def note_order(gm):
        order.append(
            [
                "gate" if "gate" in str(n.target) else "conv"
                for n in gm.graph.nodes
                if n.op == "call_function" and ("conv" in str(n.target) or "gate" in str(n.target))
            ]
        )

    opts = C.CompileOptions(backend=compile_backend, graph_passes=(note_order,))
    cm = C.CompiledModule(unet, "UNet", opts, method="_forward")
    waits: list[str] = []
    counters.clear()
    with torch.no_grad():
        for call in ("e1", "e2"):
            with sj.waiting(lambda call=call: waits.append(call)):
                got = cm(
                    x,
                    t,
                    context=ctx,
                    control=gd._JoinOnUse(plain(), call, gd.traced_join),
                    transformer_options={},
                )
            tol = C.PARITY_TOL[ref.dtype]  # relative L2: fused code keeps fp32 where eager rounds
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err <= tol, (err, tol)
    assert cm.compiles == 1 and not cm.failed and cm.eager_calls == 0, (cm.failed, cm.stats())
    assert cm.graphs == 1 and len(order) == 1 and not counters["graph_break"], (order, counters)
    assert waits == ["e1", "e2"], waits
    assert order[0].count("gate") == 1, order
    assert order[0].index("gate") == before_first_read, (order, before_first_read)


def test_compiled_controlnets_before_the_unet_match_stock(host, native, tiny_models):
    """``concurrent_controlnet`` off in compiled mode: the ControlNets' compiled code runs before
    the UNet's on one stream (on by default, and on a GPU, it runs on the side stream, which the
    other tests here cover); the run matches stock within the exact bar."""
    _compiled_run_matches_stock(host, 23, concurrent_controlnet=False)


def test_compiled_mode_lifts_the_context_projections_and_follows_a_prompt_change(
    host, native, tiny_models, monkeypatch
):
    """Compiled mode by default (``CNA_CONTEXT_HOIST`` unset): the cross-attentions' key and
    value projections are taken out of the UNet's and both ControlNets' compiled graphs and run
    once per text context. A prompt that changes at the middle step, and another prompt in the
    next run, must give stock's result: on the CPU (``aot_eager`` runs the traced ops as they
    are) bit for bit, which a stale projection would break; on a GPU within the exact bar, and
    within 90 dB of compiled mode with the projections inside the compiled code (the same matrix
    multiplies; projections kept from the first prompt put the tiny models' latent near 66
    dB)."""
    from tests.host.test_cuda_graph import CKPT, _two_prompts

    monkeypatch.delenv("CNA_CONTEXT_HOIST", raising=False)
    pack = sys.modules[host.pack_module_name]
    r = runner.Runner()
    wl = wf.WORKLOADS["T2"].with_(steps=8)

    def same(a, b):
        if host.cpu:
            assert torch.equal(a.latent, b.latent), runner.psnr(a.latent, b.latent)
        else:
            assert runner.psnr(a.latent, b.latent) >= MIN_PSNR, runner.psnr(a.latent, b.latent)

    stock, _ = _run(r, wl, 5, _two_prompts)
    got, p = _run(r, wl, 5, _chain(_two_prompts, _graph(compile="inductor")))
    same(stock, got)
    data = _badge(host, p)
    assert data["compiled"]["failed_signatures"] == 0 and data["replays"] >= 6, data
    model = r.output_of(CKPT["ckpt"])[0].model
    owners = [
        e.extras["context_hoist"]
        for e in pack.nodes.graph_state.existing_state(model).cache.entries.values()
        if e.extras.get("context_hoist") is not None
    ]
    assert owners, "no graph lifted the context projections"
    owner = owners[0]
    assert isinstance(owner, pack.graphs.context_hoist.CompiledProjections)
    unet = model.diffusion_model
    n_unet = len(pack.graphs.context_hoist.cross_attention_weights([unet]))
    lifted = sum(len(g.buffers) for g in owner.groups())
    # the UNet's and both ControlNets' projections, answered from buffers in the last pass
    assert owner.hoisted == lifted > n_unet > 0, (owner.hoisted, lifted, n_unet)
    assert owner.computed == 0
    if not host.cpu:
        with monkeypatch.context() as m:
            m.setenv("CNA_CONTEXT_HOIST", "0")
            inside, _ = _run(
                r, wl, 5, _chain(_two_prompts, _graph(compile="inductor", max_graphs=7))
            )
        assert runner.psnr(inside.latent, got.latent) >= 90, runner.psnr(inside.latent, got.latent)

    def other_prompt(p, ids):
        p[ids["pos"]]["inputs"]["text"] = "a blue window"

    stock2, _ = _run(r, wl, 5, other_prompt)
    got2, p2 = _run(r, wl, 5, _chain(other_prompt, _graph(compile="inductor")))
    same(stock2, got2)
    assert _badge(host, p2)["captures"] == 0  # same shapes: the same graphs replay


def test_unknown_compile_choice_is_refused_with_the_nodes_message(host, tiny_models):
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=2)
    with pytest.raises(Exception) as e:
        _run(r, wl, 1, _graph(compile="tensorrt"))
    msg = str(e.value)
    assert "compile" in msg and "tensorrt" in msg and "inductor" in msg, msg


def test_cuda_malloc_async_keeps_the_eager_graphs_and_says_why(host, tiny_models):
    """Under cudaMallocAsync (ComfyUI's default) compiled kernels cannot be captured, and a
    failed capture would stop all capturing in the process: compiled mode stays off, the
    badge says why, and the graphs replay the eager kernels, matching stock."""
    if not _async_allocator(host):
        pytest.skip("runs on a GPU under cudaMallocAsync (ComfyUI's default allocator)")
    r = runner.Runner()
    wl = wf.WORKLOADS["T1"].with_(steps=5)
    stock, _ = _run(r, wl, 6)
    got, p = _run(r, wl, 6, _graph(compile="inductor"))
    assert runner.psnr(stock.latent, got.latent) >= 60.0
    data = _badge(host, p)
    assert "--disable-cuda-malloc" in data["compiled"]["off"], data
    assert data["captures"] >= 1 and data["replays"] >= 3, data


def test_the_if_node_extension_is_built_only_where_the_projections_will_be_hoisted(
    host, monkeypatch
):
    """The CUDA Graph nodes build the IF nodes' extension ahead only where their graphs will run
    the context projections once per context: compiled mode by default, the exact graphs with
    ``CNA_CONTEXT_HOIST=1``, never for a model DynamicVRAM manages (handed back as it came)."""
    ncg = sys.modules[host.pack_module_name].nodes.nodes_cuda_graph

    class Plain:
        def is_dynamic(self):
            return False

    class Dynamic:
        def is_dynamic(self):
            return True

    monkeypatch.delenv("CNA_CONTEXT_HOIST", raising=False)
    assert ncg._hoists(Plain(), "inductor") and ncg._hoists(Plain(), "inductor max-autotune")
    assert not ncg._hoists(Plain(), "off") and not ncg._hoists(Dynamic(), "inductor")
    monkeypatch.setenv("CNA_CONTEXT_HOIST", "1")
    assert ncg._hoists(Plain(), "off") and not ncg._hoists(Dynamic(), "off")
    monkeypatch.setenv("CNA_CONTEXT_HOIST", "0")
    assert not ncg._hoists(Plain(), "inductor")
