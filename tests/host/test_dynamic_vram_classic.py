# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA Graph on classic copies of DynamicVRAM models (ComfyUI 0.33+).

Under DynamicVRAM no graph can hold a model's weights, so the CUDA Graph nodes run ComfyUI's
classic copy of the model (its non-dynamic delegate, read again from the checkpoint) and
classic copies of each run's ControlNets. DynamicVRAM needs an NVIDIA GPU; on the CPU these
tests stand in for it with the tiny models' own patchers answering ``is_dynamic()`` as
DynamicVRAM's do, the model's delegate being ComfyUI's own code
(``ModelPatcherDynamic.get_non_dynamic_delegate``), and DynamicVRAM's per-layer state put on
the ControlNet's layers so that a graph of the original network is refused. Tolerance:
bit-identical to stock on the CPU, since the copies hold the same weights and the graph path is
exact; under a real DynamicVRAM, within fp16 rounding (``MIN_PSNR_VS_DYNAMIC``) of classic
copies of the model and ControlNet sampled without the node and of DynamicVRAM's own run: on
the GPU a newly loaded copy's first runs can differ from later ones in the last bits.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from comfyui_controlnet_accelerator.harness import runner

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

STEPS = 3
MIN_PSNR_VS_DYNAMIC = 60.0  # dB, latent against DynamicVRAM's own run (see below)


def _pack(host):
    return sys.modules[host.pack_module_name]


@pytest.fixture
def delegate_class(host):
    """A ModelPatcher class whose instances say they are DynamicVRAM's and hand out ComfyUI's
    non-dynamic delegate, as ``ModelPatcherDynamic`` does (0.33+ only)."""
    import comfy.model_patcher as mp

    dyn = getattr(mp, "ModelPatcherDynamic", None)
    if dyn is None or not hasattr(dyn, "get_non_dynamic_delegate"):
        pytest.skip(f"ComfyUI {host.version} has no DynamicVRAM (0.33+)")

    class Dynamic(mp.ModelPatcher):
        def is_dynamic(self):
            return True

        get_non_dynamic_delegate = dyn.get_non_dynamic_delegate

    return Dynamic


def _checkpoint(tiny_models):
    import comfy.sd

    model, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(tiny_models["sd15-tiny"]), output_vae=False, output_clip=False
    )
    return model


def _as_dynamic(model, cls):
    """The model as DynamicVRAM's patcher (on a GPU with DynamicVRAM on, it is one already)."""
    if model.is_dynamic():
        return model
    model.__class__ = cls
    model.non_dynamic_delegate_model = None
    return model


def _mark_dynamic_layers(net) -> tuple[int, object]:
    """DynamicVRAM's state on a network, as its load leaves it: a VRAM-range slice (``_v``) and
    pinned-buffer handles per layer (which cannot be copied), cast flags, and its bookkeeping on
    the network (what a real DynamicVRAM patcher put there already is kept). Returns how many
    layers got a slice, and a function that takes the marks off again."""
    lock = threading.Lock()  # deepcopy refuses it: the copy must never touch these
    n, added = 0, []
    for m in net.modules():
        if hasattr(m, "comfy_cast_weights"):
            for name, value in (
                ("_v", (object(), n, 16)),
                ("_pin_state", {"buffers": lock}),
                ("comfy_cast_weights", True),
                ("seed_key", f"layer{n}"),
            ):
                if name not in vars(m):
                    setattr(m, name, value)
                    added.append((m, name))
            n += 1
    for name, value in (("dynamic_pins", {"cpu": lock}), ("model_loaded_weight_memory", 123)):
        if name not in vars(net):
            setattr(net, name, value)
            added.append((net, name))

    def unmark():
        for m, name in added:
            delattr(m, name)

    return n, unmark


def _controlled(cn, width=768):
    import nodes

    g = torch.Generator().manual_seed(5)
    pos = [[torch.randn(1, 77, width, generator=g), {}]]
    neg = [[torch.randn(1, 77, width, generator=g), {}]]
    hint = torch.rand(1, 64, 64, 3, generator=g)
    return nodes.ControlNetApplyAdvanced().apply_controlnet(pos, neg, cn, hint, 0.8, 0.0, 1.0)


def _sample(model, pos, neg):
    import nodes

    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    (out,) = nodes.common_ksampler(model, 7, STEPS, 5.0, "euler", "normal", pos, neg, latent)
    return out["samples"]


def test_classic_network_drops_dynamic_vram_state_and_keeps_the_weights(host, tiny_models):
    import comfy.controlnet

    compat = _pack(host).nodes.compat
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    net = cn.control_model
    layers, unmark = _mark_dynamic_layers(net)
    try:
        _check_classic_network(compat, net, layers)
    finally:
        unmark()  # a real DynamicVRAM patcher of this network must not meet the marks


def _check_classic_network(compat, net, layers):
    assert layers > 0 and compat.dynamic_layers(net) == layers
    assert compat.capture_blocker(net) is not None
    loaded = net.model_loaded_weight_memory

    twin = compat.classic_network(net)

    assert compat.dynamic_layers(twin) == 0 and compat.capture_blocker(twin) is None
    for m in twin.modules():
        for name in ("_v", "_pin_state", "seed_key", "comfy_cast_weights", "dynamic_pins"):
            assert name not in vars(m), (type(m).__name__, name)
        if hasattr(m, "comfy_cast_weights"):  # as the layer's class has it, not DynamicVRAM's
            assert m.comfy_cast_weights is type(m).comfy_cast_weights
    assert "model_loaded_weight_memory" not in vars(twin)
    # the original keeps its state; the weights are equal and not shared
    assert compat.dynamic_layers(net) == layers and net.model_loaded_weight_memory == loaded
    ours, theirs = twin.state_dict(), net.state_dict()
    assert ours.keys() == theirs.keys()
    for k, v in theirs.items():
        assert torch.equal(ours[k], v) and ours[k].data_ptr() != v.data_ptr(), k


def test_classic_network_copies_each_weight_alone_not_the_storage_it_views(host):
    """A loader may hand out weights that are views of one mapping of the whole file: the copy
    holds each weight's own bytes, not that storage once per weight (which ran a machine with
    128 GB of RAM out of memory on SDXL's ControlNet). Shared weights stay shared."""
    compat = _pack(host).nodes.compat
    whole = torch.randn(4096)  # the "file"
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    offset = 0
    for layer in net:
        w = whole[offset : offset + 64].view(8, 8)
        b = whole[offset + 64 : offset + 72]
        layer.weight, layer.bias = torch.nn.Parameter(w), torch.nn.Parameter(b)
        offset += 100
    net[2].weight = net[0].weight  # tied
    net.register_buffer("table", whole[4000:4010])

    twin = compat.classic_network(net)

    assert type(twin) is type(net) and twin[1] is not net[1] and type(twin[1]) is torch.nn.Linear
    for (name, ours), (_, theirs) in zip(
        twin.state_dict(keep_vars=True).items(), net.state_dict(keep_vars=True).items(), strict=True
    ):
        assert torch.equal(ours, theirs), name
        assert ours.untyped_storage().nbytes() == ours.nbytes, name  # its own bytes only
        assert ours.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        assert isinstance(ours, torch.nn.Parameter) == isinstance(theirs, torch.nn.Parameter)
    assert twin[2].weight is twin[0].weight and twin[0].weight is not net[0].weight
    x = torch.randn(3, 8)
    assert torch.equal(twin(x), net(x))
    twin[1].weight.data.add_(1)  # the copy is independent of the original
    assert not torch.equal(twin[1].weight, net[1].weight)


def test_classic_controls_copy_each_chain_once_and_leave_the_conditioning_alone(host, tiny_models):
    import comfy.controlnet

    pack = _pack(host)
    cg = pack.nodes.cuda_graph
    a = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    b = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-b"]))
    hint = torch.rand(1, 3, 64, 64)
    fused = pack.nodes.fused_apply.FusedControlNet
    inner = fused.from_controlnet(a).set_cond_hint(hint, 0.5)  # Apply ControlNet (Fused)
    outer = b.copy().set_cond_hint(hint, 0.7)
    outer.set_previous_controlnet(inner)
    b.control_model_wrapped.is_dynamic = lambda: True  # only the outer net is DynamicVRAM's
    pos_entry, neg_entry = {"control": outer, "x": 1}, {"control": outer}
    pos, neg = [pos_entry], [neg_entry]
    conds = {"positive": pos, "negative": neg}
    st = pack.nodes.graph_state.state_for(torch.nn.Linear(1, 1), 8, torch.device("cpu"))

    cg.classic_controls(conds, st)

    got = conds["positive"][0]["control"]
    assert got is conds["negative"][0]["control"]  # cond and uncond still share one chain
    assert got is not outer and conds["positive"][0]["x"] == 1
    assert pos == [pos_entry] and pos_entry["control"] is outer  # the originals untouched
    assert neg_entry["control"] is outer and outer.previous_controlnet is inner
    assert got.control_model is not b.control_model
    assert pack.nodes.compat.is_dynamic(got.control_model_wrapped) is False
    assert got.strength == 0.7 and got.cond_hint_original is hint
    prev = got.previous_controlnet
    assert prev is not inner
    if host.dynamic_vram:  # a real DynamicVRAM: every ControlNet is its
        assert prev.control_model is not a.control_model
    else:  # only the outer one is DynamicVRAM's: the inner keeps its network
        assert prev.control_model is a.control_model
    assert prev.strength == 0.5 and prev.previous_controlnet is None
    assert type(prev) is fused and prev.fused_settings is inner.fused_settings

    again = {"positive": [{"control": outer}]}
    cg.classic_controls(again, st)  # a later run: the same classic network
    assert again["positive"][0]["control"].control_model is got.control_model
    assert len(st.classic_nets) == (2 if host.dynamic_vram else 1)


def test_dynamic_vram_models_run_in_graphs_on_classic_copies_and_match_stock(
    host, tiny_models, delegate_class
):
    import comfy.controlnet

    pack = _pack(host)
    cg, compat, status = pack.nodes.cuda_graph, pack.nodes.compat, pack.nodes.status
    model = _checkpoint(tiny_models)
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    stock = _sample(model, *_controlled(cn))
    if host.dynamic_vram:  # real DynamicVRAM: its first run can differ in the last bits
        stock = _sample(model, *_controlled(cn))
    else:
        _as_dynamic(model, delegate_class)
        cn.control_model_wrapped.is_dynamic = lambda: True
        _mark_dynamic_layers(cn.control_model)  # the CPU's ControlNet is never used again
    original_net = cn.control_model

    out = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="classic-1")

    assert not compat.is_dynamic(out) and out.model is not model.model
    assert cg.WRAPPER_KEY in str(out.wrappers)
    got = _sample(out, *_controlled(cn))
    # the reference: classic copies of the model and the ControlNet, sampled without the node
    copy, why = compat.classic_control_patcher(cn.control_model_wrapped)
    assert copy is not None, why
    ref = cn.copy()
    ref.control_model, ref.control_model_wrapped = copy.model, copy
    delegate = model.get_non_dynamic_delegate()
    classic = _sample(delegate, *_controlled(ref))
    if host.dynamic_vram:
        # On a GPU the first runs of a newly loaded copy can differ from later ones in the last
        # bits (cuDNN's algorithm choice; seen on an H100): compare a warm run, and allow fp16
        # rounding, as against DynamicVRAM's own run.
        classic = _sample(delegate, *_controlled(ref))
        assert runner.psnr(classic, got) >= MIN_PSNR_VS_DYNAMIC, runner.psnr(classic, got)
    else:
        assert torch.equal(classic, got)
    if host.dynamic_vram:
        # DynamicVRAM computes from weights in its own VRAM range, where cuBLAS may pick other
        # kernels than for the classic copies (over 90 dB on an H100): fp16 rounding.
        assert runner.psnr(stock, got) >= MIN_PSNR_VS_DYNAMIC, runner.psnr(stock, got)
    else:
        assert torch.equal(stock, got)
    badge = status.LAST["classic-1"]["data"]
    assert badge["replays"] > 0 and badge["captures"] > 0, badge
    assert badge["classic_copies"] is True  # the badge says what the graphs run on
    assert any("classic copies" in line for line in status.LAST["classic-1"]["lines"])
    assert not badge.get("eager_reasons"), badge
    assert cn.control_model is original_net and compat.dynamic_layers(original_net) > 0

    # the same loaded model again (a second prompt): ComfyUI's copy is not read again, and
    # the ControlNet's classic copy is the one made before
    st = cg.existing_state(out.model)
    nets = dict(st.classic_nets)
    again = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="classic-2")
    assert again.model is out.model
    second = _sample(again, *_controlled(cn))
    if host.dynamic_vram:  # on an H100 the first run differed from later ones (about 70 dB)
        assert runner.psnr(got, second) >= MIN_PSNR_VS_DYNAMIC, runner.psnr(got, second)
    else:
        assert torch.equal(got, second)
    assert status.LAST["classic-2"]["data"]["replays"] > 0
    assert dict(st.classic_nets) == nets and len(nets) == 1


def test_a_dynamic_vram_model_without_a_classic_copy_passes_through_and_says_why(
    host, tiny_models, delegate_class, caplog
):
    import logging

    pack = _pack(host)
    cg, compat, status = pack.nodes.cuda_graph, pack.nodes.compat, pack.nodes.status
    model = _as_dynamic(_checkpoint(tiny_models), delegate_class)
    model.cached_patcher_init = None  # a custom loader's model: ComfyUI cannot read it again
    compat._warned.discard("graph:dynamic:CUDA Graph")
    with caplog.at_level(logging.WARNING):
        out = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="classic-none")
    assert out is model
    said = status.LAST["classic-none"]["data"]["passed_through"]
    assert said.startswith(compat.DYNAMIC_PASS_THROUGH) and "custom loader" in said
    # without DynamicVRAM, ComfyUI loads that model the classic way: the restart is the fix
    assert said.endswith(compat.RESTART_ADVICE)
    assert "--disable-dynamic-vram" in status.LAST["classic-none"]["lines"][0]
    assert any("custom loader" in m for m in caplog.messages)


@pytest.mark.parametrize("whole", [True, False])
def test_a_model_over_the_copy_share_is_told_to_restart_only_if_it_would_load_whole(
    host, tiny_models, delegate_class, monkeypatch, whole
):
    """A model over the share of VRAM a classic copy may take: restarting without DynamicVRAM
    helps only where ComfyUI would then load it whole; a larger one is left to DynamicVRAM's
    streaming, and neither the log nor the badge tells the user to restart."""
    pack = _pack(host)
    cg, compat, status = pack.nodes.cuda_graph, pack.nodes.compat, pack.nodes.status
    model = _as_dynamic(_checkpoint(tiny_models), delegate_class)
    monkeypatch.setattr(compat, "CLASSIC_VRAM_SHARE", 0.0)
    monkeypatch.setattr(compat, "WHOLE_LOAD_SHARE", 1.0 if whole else 0.0)

    out = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="classic-large")

    assert out is model
    said = status.LAST["classic-large"]["data"]["passed_through"]
    line = status.LAST["classic-large"]["lines"][0]
    assert said.startswith(compat.DYNAMIC_PASS_THROUGH) and "over 0%" in said, said
    if whole:
        assert said.endswith(compat.RESTART_ADVICE) and "--disable-dynamic-vram" in line
    else:
        assert said.endswith(compat.TOO_LARGE_ADVICE), said
        assert "--disable-dynamic-vram" not in said + line and "too large" in line


def test_a_controlnet_copy_that_failed_is_not_tried_again_one_short_of_ram_is(
    host, tiny_models, monkeypatch
):
    """A deep copy that failed fails again: it is tried once per network, not at every run.
    Too little free RAM can pass, so that is asked again at the next run."""
    import comfy.controlnet

    pack = _pack(host)
    compat = pack.nodes.compat
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    st = pack.nodes.graph_state.state_for(torch.nn.Linear(1, 1), 8, torch.device("cpu"))
    copies = []

    def failing_copy(net):
        copies.append(net)
        raise RuntimeError("cannot copy")

    monkeypatch.setattr(compat, "classic_network", failing_copy)
    assert st.classic_net(cn.control_model_wrapped) is None
    assert st.classic_net(cn.control_model_wrapped) is None
    assert copies == [cn.control_model]  # one try
    assert "copying it failed" in st.no_classic[cn.control_model]

    other = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-b"]))
    asked = []

    def short_of_ram(patcher, size, in_ram):
        asked.append(size)
        return compat.NoCopy("too little free RAM", lasting=False)

    monkeypatch.setattr(compat, "_room_for", short_of_ram)
    assert st.classic_net(other.control_model_wrapped) is None
    assert st.classic_net(other.control_model_wrapped) is None
    assert len(asked) == 2 and other.control_model not in st.no_classic
    monkeypatch.undo()  # RAM freed: the next run gets its copy
    got = st.classic_net(other.control_model_wrapped)
    assert got is not None and got.model is not other.control_model
    assert st.classic_net(other.control_model_wrapped) is got
