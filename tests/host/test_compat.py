# SPDX-License-Identifier: GPL-3.0-or-later
"""The compatibility seam (``nodes/compat.py``) against the ComfyUI tree in use (0.3.64 or 0.33):
wrapper arguments pass through, the executor starts on either signature, models are unloaded
through ComfyUI's ``free_memory``, DynamicVRAM is detected, and the Memory Pool never edits a
patcher another node returned."""

from __future__ import annotations

import inspect
import logging
import sys

import pytest
import torch

pytestmark = pytest.mark.host


def _pack(host):
    return sys.modules[host.pack_module_name]


def _loaded(tiny_models):
    import comfy.sd

    model, _, _, _ = comfy.sd.load_checkpoint_guess_config(
        str(tiny_models["sd15-tiny"]), output_vae=False, output_clip=False
    )
    return model


def test_version_is_read_from_the_tree(host):
    compat = _pack(host).nodes.compat
    from comfyui_controlnet_accelerator.harness import comfy_host

    v = compat.comfyui_version()
    assert v is not None and v == host.version == comfy_host.comfyui_version(host.root)
    assert compat.version_tuple(v)[:2] in ((0, 3), (0, 33)) and compat.version_tuple("x") == ()


def test_prepare_sampling_args_by_position_or_keyword(host):
    compat = _pack(host).nodes.compat
    a = compat.prepare_sampling_args(("m", (1, 4, 8, 8), {"c": 1}), {"model_options": {"o": 1}})
    assert a == {"model": "m", "noise_shape": (1, 4, 8, 8), "conds": {"c": 1},
                 "model_options": {"o": 1}}  # fmt: skip
    b = compat.prepare_sampling_args((), {"model": "m", "conds": {}, "force_full_load": True})
    assert b["model"] == "m" and b["conds"] == {} and b["model_options"] is None
    assert "force_full_load" not in b


def test_the_executor_starts_on_this_versions_signature(host):
    import execution

    compat = _pack(host).nodes.compat
    from comfyui_controlnet_accelerator.harness import comfy_host

    ex = compat.prompt_executor(comfy_host.HeadlessServer())
    assert ex.cache_type == execution.CacheType.CLASSIC
    if "cache_args" in inspect.signature(execution.PromptExecutor.__init__).parameters:
        assert ex.cache_args["ram"] == 0 and ex.cache_args["ram_inactive"] == 0


class _Executor:
    """Records what a wrapper passes on to ComfyUI's function."""

    def __init__(self, class_obj=None, during=None):
        self.class_obj, self.during, self.calls = class_obj, during, []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.during is not None:
            self.during()
        return "result"


@pytest.mark.parametrize("weights", ["as loaded", "int8"])
def test_memory_pool_prepare_sampling_passes_new_arguments_through(host, tiny_models, weights):
    """0.33 calls PREPARE_SAMPLING wrappers with force_full_load/force_offload; whatever comes
    reaches ComfyUI unchanged, and ComfyUI's estimate is its own again afterwards."""
    mp = _pack(host).nodes.memory_pool
    compat = _pack(host).nodes.compat
    model = _loaded(tiny_models)
    m, _ = mp.apply_memory_pool(model, None, mp.PoolOptions(unet_weights=weights))
    import comfy.patcher_extension as pe

    (wrapper,) = m.get_wrappers(pe.WrappersMP.PREPARE_SAMPLING, mp.WRAPPER_KEY)
    seen = {}
    ex = _Executor(during=lambda: seen.update(inner=m.model.memory_required([2, 4, 8, 8])))
    before = m.model.memory_required([2, 4, 8, 8])
    out = wrapper(ex, m, (1, 4, 8, 8), {}, model_options={}, force_full_load=True, new_arg=3)
    assert out == "result"
    ((args, kwargs),) = ex.calls
    assert args == (m, (1, 4, 8, 8), {})
    assert kwargs == {"model_options": {}, "force_full_load": True, "new_arg": 3}
    patch = wrapper.__self__
    reserve = patch.reserve_bytes([m])
    assert (reserve > 0) == (weights == "int8")
    # the pool's working memory, for this call only; under DynamicVRAM (0.33 on an NVIDIA GPU,
    # where this model is a ModelPatcherDynamic) nothing is added: ComfyUI then finds working
    # memory by evicting weights on demand
    added = 0 if compat.is_dynamic(m) else reserve
    assert compat.is_dynamic(m) == host.dynamic_vram
    assert seen["inner"] == before + added and patch.reserved == added
    assert "memory_required" not in vars(m.model)


def test_memory_pool_outer_sample_passes_new_arguments_through(host, tiny_models):
    mp = _pack(host).nodes.memory_pool
    m, _ = mp.apply_memory_pool(_loaded(tiny_models), None, mp.PoolOptions())
    import comfy.patcher_extension as pe

    (wrapper,) = m.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, mp.WRAPPER_KEY)
    guider = type("Guider", (), {"model_patcher": m, "conds": {}})()
    ex = _Executor(class_obj=guider)
    assert wrapper(ex, "noise", "latent", latent_shapes=[(1, 4, 8, 8)]) == "result"
    assert ex.calls == [(("noise", "latent"), {"latent_shapes": [(1, 4, 8, 8)]})]


class _Guider:
    """A guider as ComfyUI's samplers use it: OUTER_SAMPLE wrappers run around its bound
    ``outer_sample`` (``WrapperExecutor``), which reads ``self.model_patcher``."""

    def __init__(self, patcher, during):
        self.model_patcher, self.conds, self.during = patcher, {}, during

    def outer_sample(self, *args, **kwargs):
        self.inner_model = "set by the sampler"  # outer_sample writes on its guider
        self.during(self)
        return ("sampled", args, kwargs)

    def sample(self, wrappers, *args, **kwargs):
        import comfy.patcher_extension as pe

        return pe.WrapperExecutor.new_class_executor(self.outer_sample, self, wrappers).execute(
            *args, **kwargs
        )


def test_a_later_lora_is_handled_on_a_clone_never_on_the_lora_nodes_output(host, tiny_models):
    """A LoRA applied after the pool: this run samples a clone without our patch on that layer,
    through a copy of the guider; the LoRA node's patcher and the guider (both can be cached
    outputs of other nodes) are left exactly as they were, during the run too."""
    mp = _pack(host).nodes.memory_pool
    model = _loaded(tiny_models)
    m, _ = mp.apply_memory_pool(model, None, mp.PoolOptions())
    name = next(k for k, v in m.object_patches.items() if isinstance(v, mp.wc._Replaced))
    w = model.model.state_dict()[f"{name}.weight"]
    lora = m.clone()
    lora.add_patches({f"{name}.weight": (torch.full_like(w, 0.01),)}, 1.0)
    before = dict(lora.object_patches)
    sampled, seen, ran_on = [], [], []

    def during(g):
        p = g.model_patcher
        sampled.append(p)
        ran_on.append(g)
        seen.append(
            dict(
                copy=g is not guider,
                guider_as_made=guider.model_patcher is lora and "inner_model" not in vars(guider),
                clone=p is not lora,
                has=name in p.object_patches,
                n=len(p.object_patches),
            )
        )

    import comfy.patcher_extension as pe

    guider = _Guider(lora, during)
    state = dict(vars(guider))
    (wrapper,) = lora.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, mp.WRAPPER_KEY)
    later = []  # a wrapper after the pool's sees the copy too, and passes arguments on

    def after(executor, *args, **kwargs):
        later.append(executor.class_obj)
        return executor(*args, **kwargs)

    out = guider.sample([wrapper, after], "noise", latent_shapes=[(1, 4, 8, 8)])
    assert out == ("sampled", ("noise",), {"latent_shapes": [(1, 4, 8, 8)]})
    want = {"copy": True, "guider_as_made": True, "clone": True, "has": False}
    assert seen[0] == {**want, "n": len(before) - 1} and later[0] is not guider
    assert vars(guider) == state and lora.object_patches == before
    # the same prompt again samples the same clone (ComfyUI keeps it loaded, no re-patching)
    guider.sample([wrapper], "noise")
    assert len(sampled) == 2 and sampled[0] is sampled[1]
    # the pool's own output, with no later LoRA, is sampled as it is, on the guider itself
    plain = _Guider(m, during)
    plain.sample([wrapper], "noise")
    assert sampled[-1] is m and ran_on[-1] is plain


def test_a_later_lora_on_a_sampler_that_cannot_be_copied_is_a_clear_error(host, tiny_models):
    mp = _pack(host).nodes.memory_pool
    errors = _pack(host).errors
    model = _loaded(tiny_models)
    m, _ = mp.apply_memory_pool(model, None, mp.PoolOptions())
    name = next(k for k, v in m.object_patches.items() if isinstance(v, mp.wc._Replaced))
    lora = m.clone()
    w = model.model.state_dict()[f"{name}.weight"]
    lora.add_patches({f"{name}.weight": (torch.full_like(w, 0.01),)}, 1.0)
    import comfy.patcher_extension as pe

    (wrapper,) = lora.get_wrappers(pe.WrappersMP.OUTER_SAMPLE, mp.WRAPPER_KEY)
    guider = type("Guider", (), {"model_patcher": lora, "conds": {}})()
    ex = _Executor(class_obj=guider)  # no bound method to move onto a copy
    with pytest.raises(errors.NodeInputError, match="before the ControlNet Memory Pool"):
        wrapper(ex)
    assert ex.calls == [] and guider.model_patcher is lora


def test_unloading_goes_through_comfyuis_free_memory(host, tiny_models, monkeypatch):
    import comfy.model_management as mm

    compat = _pack(host).nodes.compat
    a, b = _loaded(tiny_models), _loaded(tiny_models)
    mm.load_models_gpu([a, b])
    assert {id(p) for p in compat.loaded_patchers()} >= {id(a), id(b)}
    asked = []
    orig = mm.free_memory

    def spy(memory_required, device, keep_loaded=(), **kw):
        asked.append({id(lm.model) for lm in keep_loaded})
        return orig(memory_required, device, keep_loaded=keep_loaded, **kw)

    monkeypatch.setattr(mm, "free_memory", spy)
    gone = compat.unload_models_of(a)
    assert [id(p) for p in gone] == [id(a)] and id(b) in asked[-1] and id(a) not in asked[-1]
    loaded = {id(p) for p in compat.loaded_patchers()}
    assert id(a) not in loaded and id(b) in loaded
    gone = compat.unload_all_but([b], b.load_device)
    assert id(b) in {id(p) for p in compat.loaded_patchers()}
    assert id(b) not in {id(p) for p in gone}
    mm.unload_all_models()


def test_dynamic_vram_is_detected_and_the_pool_leaves_working_memory_to_it(
    host, tiny_models, caplog
):
    compat = _pack(host).nodes.compat
    mp = _pack(host).nodes.memory_pool
    model = _loaded(tiny_models)
    assert compat.is_dynamic(model) == bool(getattr(model, "is_dynamic", lambda: False)())
    if host.cpu:  # 0.33 never uses ModelPatcherDynamic on the CPU; 0.3.64 has none
        assert not compat.dynamic_vram_enabled() and not compat.is_dynamic(model)
    m, _ = mp.apply_memory_pool(model, None, mp.PoolOptions())
    m.is_dynamic = lambda: True  # a DynamicVRAM patcher, as 0.33 makes them on NVIDIA GPUs
    import comfy.patcher_extension as pe

    (wrapper,) = m.get_wrappers(pe.WrappersMP.PREPARE_SAMPLING, mp.WRAPPER_KEY)
    seen = {}
    ex = _Executor(during=lambda: seen.update(edited="memory_required" in vars(m.model)))
    compat._warned.discard("pool:dynamic")
    with caplog.at_level(logging.INFO):
        wrapper(ex, m, (1, 4, 8, 8), {}, model_options={})
        wrapper(ex, m, (1, 4, 8, 8), {}, model_options={})
    assert seen == {"edited": False} and len(ex.calls) == 2
    lines = [r for r in caplog.records if "DynamicVRAM is on" in r.getMessage()]
    assert len(lines) == 1  # once per process
    # it sets the expectation (memory saved, steps slower) and names the way to the graphs
    msg = lines[0].getMessage()
    assert "slower" in msg and "--disable-dynamic-vram" in msg


def test_comfyuis_own_cuda_graphs_never_hold_our_models(host, tiny_models):
    """ComfyUI 0.33 captures graphs only for LLM text-encoder layers (model_prefetch.py); the
    check the pack can use says False for an SD UNet and True once a module holds one."""
    compat = _pack(host).nodes.compat
    unet = _loaded(tiny_models).model.diffusion_model
    assert not compat.comfyui_captures(unet)
    layer = torch.nn.Linear(2, 2)
    layer._comfy_graph = {"graph": object(), "signature": None}
    assert compat.comfyui_captures(torch.nn.Sequential(layer))
    assert not compat.comfyui_captures(object())


def test_a_missing_wrapper_type_fails_soft_with_one_line(host, caplog, monkeypatch):
    compat = _pack(host).nodes.compat
    import comfy.patcher_extension as pe

    class Patcher:
        def remove_wrappers_with_key(self, *a):
            raise AssertionError("not called")

        add_wrapper_with_key = remove_wrappers_with_key

    monkeypatch.delattr(pe.WrappersMP, "CALC_COND_BATCH")
    compat._warned.discard("wrapper:CALC_COND_BATCH")
    with caplog.at_level(logging.WARNING):
        assert compat.set_wrapper(Patcher(), "CALC_COND_BATCH", "k", print) is False
        assert compat.set_wrapper(Patcher(), "CALC_COND_BATCH", "k", print) is False
    assert sum("no CALC_COND_BATCH wrapper" in r.getMessage() for r in caplog.records) == 1


def test_the_pool_reserves_working_memory_only_without_dynamic_vram(host):
    """The decision alone: the legacy loader is told the pool's working memory; DynamicVRAM
    (which evicts weights for any allocation that finds no room) is told nothing."""
    mp = _pack(host).nodes.memory_pool
    assert mp.working_memory_to_reserve(False, 3 << 20) == 3 << 20
    assert mp.working_memory_to_reserve(False, 0) == 0
    assert mp.working_memory_to_reserve(False, -5) == 0
    assert mp.working_memory_to_reserve(True, 3 << 20) == 0


def test_a_reserve_is_not_carried_over_to_a_run_that_needs_none(host, tiny_models):
    """The badge's "kept free for the pool" is the last run's figure, never an older one's:
    a run with nothing to reserve (weights as loaded, or DynamicVRAM) reports 0."""
    mp = _pack(host).nodes.memory_pool
    import comfy.patcher_extension as pe

    for weights, dynamic in (("as loaded", None), ("int8", True)):
        m, _ = mp.apply_memory_pool(_loaded(tiny_models), None, mp.PoolOptions(weights))
        if dynamic:
            m.is_dynamic = lambda: True  # a DynamicVRAM patcher, as 0.33 makes them on a GPU
        (wrapper,) = m.get_wrappers(pe.WrappersMP.PREPARE_SAMPLING, mp.WRAPPER_KEY)
        patch = wrapper.__self__
        patch.reserved = 123  # as an earlier run left it
        wrapper(_Executor(), m, (1, 4, 8, 8), {}, model_options={})
        assert patch.reserved == 0, weights


class _Layer(torch.nn.Linear):
    pass


def test_layers_dynamic_vram_manages_are_counted_and_block_capture(host):
    """``ModelPatcherDynamic.load`` gives each layer whose weights it faults in a slice of the
    model's virtual VRAM range (``_v``); a model with any such layer is not captured."""
    compat = _pack(host).nodes.compat
    net = torch.nn.Sequential(_Layer(4, 4), torch.nn.Sequential(_Layer(4, 4), torch.nn.ReLU()))
    assert compat.dynamic_layers(net) == 0 and compat.capture_blocker(net) is None
    net[1][0]._v = ("vbar", 0x7F0000000000, 64)  # (vbar, address, size), as 0.33 sets it
    assert compat.dynamic_layers(net) == 1
    why = compat.capture_blocker(net)
    assert why is not None and "DynamicVRAM" in why and "--disable-dynamic-vram" in why
    net[0]._v = None  # a layer loaded whole has no slice
    assert compat.dynamic_layers(net) == 1
    assert compat.dynamic_layers(object()) == 0 and compat.capture_blocker(object()) is None


def test_a_loaded_model_is_dynamic_exactly_when_dynamic_vram_is_on(host, tiny_models):
    """The real loader: under DynamicVRAM (0.33 on an NVIDIA GPU) loading the UNet gives its
    large layers virtual-VRAM slices, so the pack's graph capture stands aside; with the legacy
    loader (0.3.64, the CPU, --disable-dynamic-vram) there are none."""
    import comfy.model_management as mm

    compat = _pack(host).nodes.compat
    model = _loaded(tiny_models)
    mm.load_models_gpu([model])
    unet = model.model.diffusion_model
    n = compat.dynamic_layers(unet)
    assert (n > 0) == compat.is_dynamic(model) == host.dynamic_vram
    assert (compat.capture_blocker(unet) is not None) == (n > 0)
    if n:  # their parameters stay where the checkpoint was loaded, not on the GPU
        assert all(
            not p.is_cuda
            for m in unet.modules()
            if getattr(m, "_v", None) is not None
            for p in m.parameters(recurse=False)
        )
    mm.unload_all_models()


class _DynamicPatcher:
    """Stands for a ModelPatcherDynamic: one range per network, made at the first loader's size
    (as ``ModelPatcherDynamic._vbar_get`` does)."""

    def __init__(self, size, ranges, dynamic=True):
        self.size, self.ranges, self.dynamic = size, ranges, dynamic

    def is_dynamic(self):
        return self.dynamic

    def _vbar_get(self, create=False):
        if create and "range" not in self.ranges:
            self.ranges["range"] = self.size * 10
        return self.ranges.get("range")


def test_the_dynamic_range_is_sized_by_the_full_network(host, caplog):
    compat = _pack(host).nodes.compat
    ranges: dict = {}
    full, pooled = _DynamicPatcher(1000, ranges), _DynamicPatcher(1, ranges)
    assert compat.size_dynamic_range(full) is True and ranges["range"] == 10000
    assert compat.size_dynamic_range(pooled) is True and ranges["range"] == 10000  # kept
    legacy: dict = {}
    assert compat.size_dynamic_range(_DynamicPatcher(5, legacy, dynamic=False)) is False
    assert legacy == {}

    class Old(_DynamicPatcher):  # a DynamicVRAM without the per-network range
        _vbar_get = None

    compat._warned.discard("vbar")
    with caplog.at_level(logging.WARNING):
        assert compat.size_dynamic_range(Old(5, {})) is False
        assert compat.size_dynamic_range(Old(5, {})) is False
    assert sum("VRAM range" in r.getMessage() for r in caplog.records) == 1


def test_a_stock_controlnet_loads_after_its_streamed_clone(host, tiny_models):
    """The streamed ControlNet's clone reports about 0.1% of the network's size and loads
    first; the same ControlNet without the pool then loads too (under DynamicVRAM its shared
    virtual VRAM range was made at the full size, not at the clone's)."""
    import comfy.controlnet
    import comfy.model_management as mm

    compat = _pack(host).nodes.compat
    mp = _pack(host).nodes.memory_pool
    model = _loaded(tiny_models)
    cn = comfy.controlnet.load_controlnet(str(tiny_models["sd15-tiny-cn-a"]))
    full = cn.control_model_wrapped.model_size()
    _, pooled = mp.apply_memory_pool(
        model, cn, mp.PoolOptions(unet_weights="as loaded", controlnet_weights="stream")
    )
    assert pooled.control_model_wrapped.model_size() < 0.01 * full
    mm.load_models_gpu([pooled.control_model_wrapped])
    mm.load_models_gpu([cn.control_model_wrapped])  # stock: raised "VBAR OOM" when too small
    assert any(lm.model is cn.control_model_wrapped for lm in mm.current_loaded_models)
    ranges = getattr(cn.control_model, "dynamic_vbars", {})
    assert bool(ranges) == compat.is_dynamic(cn.control_model_wrapped) == host.dynamic_vram
    for vbar in ranges.values():
        assert vbar.max_size == 10 * full
    mm.unload_all_models()


def test_a_dynamic_vram_model_passes_through_the_cuda_graph_node_untouched(
    host, tiny_models, caplog
):
    """Under DynamicVRAM no graph can hold the weights; without a classic copy (here: a custom
    loader's model) the node hands the model on as it came (no clone, no wrapper), says so
    once in the log and on its badge."""
    pack = _pack(host)
    cg, compat, status = pack.nodes.cuda_graph, pack.nodes.compat, pack.nodes.status
    model = _loaded(tiny_models)
    model.cached_patcher_init = None  # a custom loader's: no classic copy can be read again
    if not compat.is_dynamic(model):  # DynamicVRAM off, or a ComfyUI without it
        plain = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="cg-plain")
        assert plain is not model and plain.wrappers != model.wrappers  # a normal model: wrapped
        model.is_dynamic = lambda: True  # a DynamicVRAM patcher, as 0.33 makes them on GPUs
    ksampler = "KSampler (CUDA Graph)"
    for name in ("CUDA Graph", ksampler):
        compat._warned.discard(f"graph:dynamic:{name}")
    with caplog.at_level(logging.WARNING):
        out = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="cg-dyn")
        again = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="cg-dyn2")
        said = [m for m in caplog.messages if "--disable-dynamic-vram" in m]
        assert len(said) == 1 and said[0].startswith("CUDA Graph: ")
        # the KSampler node names itself, not the other node
        ks = cg.apply_cuda_graph(model, cg.GraphOptions(), node_id="ks-dyn", node_name=ksampler)
    assert out is model and again is model and ks is model
    said = [m for m in caplog.messages if "--disable-dynamic-vram" in m]
    assert len(said) == 2 and said[1].startswith(f"{ksampler}: "), said
    badge = status.LAST["cg-dyn"]
    assert badge["kind"] == "cuda_graph" and "DynamicVRAM" in badge["lines"][0]
    assert badge["data"]["passed_through"].startswith(compat.DYNAMIC_PASS_THROUGH)


@pytest.mark.parametrize("disabled", [False, True])
def test_the_harness_starts_dynamic_vram_reading_pressure_as_main_py_does(
    host, monkeypatch, disabled
):
    """0.33's main.py starts comfy-aimdo with ``nvml_pressure`` (every process's use of the card)
    unless --disable-nvml-pressure; the harness must ask the same, or a card shared with another
    process behaves unlike the user's."""
    import comfy.cli_args as cli

    control = pytest.importorskip("comfy_aimdo.control")
    from comfyui_controlnet_accelerator.harness import comfy_host

    calls = []
    monkeypatch.setattr(cli, "enables_dynamic_vram", lambda: True, raising=False)
    monkeypatch.setattr(control, "init", lambda **kw: calls.append(kw) or True)
    args = type("Args", (), {"reserve_vram": 1.5, "disable_nvml_pressure": disabled})()
    comfy_host._load_aimdo(args)
    assert calls == [{"simple_vram_headroom": int(1.5 * 1024**3), "nvml_pressure": not disabled}]
