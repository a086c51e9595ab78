# SPDX-License-Identifier: GPL-3.0-or-later
"""Compiled mode's run setup (nodes/compiled_step.py) without ComfyUI: when it turns on, when it
refuses and why, and what it does with ComfyUI's TorchCompileModel wrapper."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.graphs import compiled as C
from comfyui_controlnet_accelerator.graphs.compiled import CompileOptions
from comfyui_controlnet_accelerator.nodes import compiled_step as cs


def _tcm_options() -> dict:
    return {
        "transformer_options": {"wrappers": {"apply_model": {cs.TORCH_COMPILE_KEY: [object()]}}},
        cs.TORCH_COMPILE_KWARGS: {"backend": "inductor", "mode": "max-autotune", "dynamic": None},
    }


@pytest.fixture
def allocator(monkeypatch):
    def use(backend: str | None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: backend is not None)
        monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: backend)

    return use


def test_off_unless_asked(allocator):
    allocator("native")
    opts = {"transformer_options": {}}
    assert cs.begin_run(None, opts, torch.nn.Linear(2, 2)) == (None, None)
    assert cs.COMPILE_RUN_KEY not in opts["transformer_options"]


def test_node_setting_puts_a_run_in_the_runs_options(allocator):
    allocator("native")
    model = torch.nn.Linear(2, 2)
    opts = {"transformer_options": {}}
    run, why = cs.begin_run(CompileOptions(), opts, model)
    assert why is None and run is opts["transformer_options"][cs.COMPILE_RUN_KEY]
    assert run.options == CompileOptions() and run.source == "node"
    # the model's compiled networks are kept across runs; new settings start afresh
    again, _ = cs.begin_run(CompileOptions(), {"transformer_options": {}}, model)
    assert again.model is run.model
    other, _ = cs.begin_run(
        CompileOptions(mode="max-autotune-no-cudagraphs"), {"transformer_options": {}}, model
    )
    assert other.model is not run.model


def test_a_model_keeps_two_settings_compiled_and_drops_the_least_recent(monkeypatch):
    model = torch.nn.Linear(2, 2)
    a, b, c = (
        CompileOptions(),
        CompileOptions(mode="max-autotune-no-cudagraphs"),
        CompileOptions(dynamic="dynamic"),
    )
    resets = []
    monkeypatch.setattr(
        cs.CompileCache, "reset", lambda self: resets.append(self.options), raising=True
    )
    ma, mb = cs.model_compile(model, a), cs.model_compile(model, b)
    assert cs.model_compile(model, a) is ma and cs.model_compile(model, b) is mb and not resets
    cs.model_compile(model, a)  # b is now the least recently used
    mc = cs.model_compile(model, c)
    assert resets == [b] and mc is not ma and mc is not mb
    assert cs.model_compile(model, a) is ma  # kept
    assert cs.model_compile(model, b) is not mb  # dropped, so compiled afresh


def test_geglu_switch_gives_other_settings(monkeypatch):
    from comfyui_controlnet_accelerator.kernels import fx_rewrites

    monkeypatch.delenv(fx_rewrites.GEGLU_ENV, raising=False)  # off unless asked for
    off = cs.options_for("inductor")
    assert not any(isinstance(p, fx_rewrites.GegluRewrite) for p in off.graph_passes)
    monkeypatch.setenv(fx_rewrites.GEGLU_ENV, "1")
    on = cs.options_for("inductor")
    assert any(isinstance(p, fx_rewrites.GegluRewrite) for p in on.graph_passes)
    assert off != on and off.mode == on.mode
    tuned = cs.options_for("inductor max-autotune")
    assert any(isinstance(p, fx_rewrites.GegluRewrite) for p in tuned.graph_passes)
    assert cs.options_for("off") is None


def test_attention_choice_switch_gives_other_settings(monkeypatch):
    from comfyui_controlnet_accelerator.kernels import attention_choice

    monkeypatch.setenv(attention_choice.ENV, "off")
    off = cs.options_for("inductor")
    assert not any(isinstance(p, attention_choice.AttentionBackendChoice) for p in off.graph_passes)
    monkeypatch.delenv(attention_choice.ENV)  # the default: flash-first attentions only
    auto = cs.options_for("inductor")
    assert auto.graph_passes[-1] is cs.ATTENTION_CHOICE_AUTO
    assert cs.ATTENTION_CHOICE_AUTO.first_in == ("FLASH_ATTENTION",)
    monkeypatch.setenv(attention_choice.ENV, "fastest")
    on = cs.options_for("inductor max-autotune")
    assert on.graph_passes[-1] is cs.ATTENTION_CHOICE and on.mode == "max-autotune-no-cudagraphs"
    assert on.graph_passes[-1].first_in is None
    every = cs.options_for("inductor")
    assert len({off, auto, every}) == 3 and every == cs.options_for("inductor")
    path = cs.ATTENTION_CHOICE.cache_file()
    assert path.name == cs.ATTENTION_FILE and path.parent == cs.compile_cache_dir()


def test_dynamic_shapes_switch_gives_other_settings(monkeypatch):
    monkeypatch.delenv(cs.DYNAMIC_ENV, raising=False)
    static = cs.options_for("inductor max-autotune")
    monkeypatch.setenv(cs.DYNAMIC_ENV, "1")
    dynamic = cs.options_for("inductor max-autotune")
    assert (static.dynamic, dynamic.dynamic) == ("static", "dynamic")
    assert dynamic.mode == static.mode == "max-autotune-no-cudagraphs"
    assert dynamic != static  # kept apart per model (model_compile keys on the settings)
    monkeypatch.setenv(cs.DYNAMIC_ENV, "0")
    assert cs.options_for("inductor").dynamic == "static"
    assert cs.options_for("off") is None


@pytest.mark.parametrize(
    "env, field", [(cs.DEDUPE_ENV, "dedupe_regions"), (cs.NESTED_ENV, "nested_breaks")]
)
def test_dynamo_switches_give_settings_of_their_own(monkeypatch, env, field):
    monkeypatch.delenv(env, raising=False)
    plain = cs.options_for("inductor")
    monkeypatch.setenv(env, "1")
    on = cs.options_for("inductor")
    assert (getattr(plain, field), getattr(on, field)) == (False, True)
    assert on != plain  # kept apart per model (model_compile keys on the settings)
    assert on.graph_passes == plain.graph_passes
    assert on.inductor_config() == plain.inductor_config()
    monkeypatch.setenv(env, "0")
    assert cs.options_for("inductor") == plain


def test_tuning_switch_adds_the_diffusion_recipe_to_inductors_settings(monkeypatch):
    monkeypatch.delenv(cs.TUNING_ENV, raising=False)
    plain = cs.options_for("inductor")
    monkeypatch.setenv(cs.TUNING_ENV, "1")
    tuned = cs.options_for("inductor")
    assert plain.inductor_options == () and tuned != plain  # kept apart per model
    cfg = tuned.inductor_config()
    assert cfg["coordinate_descent_tuning"] is True and cfg["conv_1x1_as_mm"] is True
    assert cfg["epilogue_fusion"] is False and cfg["triton.cudagraphs"] is False
    assert "coordinate_descent_tuning" not in plain.inductor_config()
    auto = cs.options_for("inductor max-autotune")
    assert auto.mode == "max-autotune-no-cudagraphs"
    assert auto.inductor_options == tuned.inductor_options
    monkeypatch.setenv(cs.TUNING_ENV, "0")
    assert cs.options_for("inductor") == plain


def test_context_projections_are_lifted_in_compiled_mode_by_default(monkeypatch):
    """Unset, ``CNA_CONTEXT_HOIST`` lifts the context projections out of compiled mode's code and
    leaves the exact graphs' step as it is; ``1`` and ``0`` decide for both."""
    monkeypatch.delenv(cs.CONTEXT_HOIST_ENV, raising=False)
    assert cs.options_for("inductor").lift_context is True
    assert cs.options_for("inductor max-autotune").lift_context is True
    assert (cs.context_hoist_on(compiled=True), cs.context_hoist_on()) == (True, False)
    monkeypatch.setenv(cs.CONTEXT_HOIST_ENV, "0")
    assert cs.options_for("inductor").lift_context is False
    assert (cs.context_hoist_on(compiled=True), cs.context_hoist_on()) == (False, False)
    monkeypatch.setenv(cs.CONTEXT_HOIST_ENV, "1")
    assert cs.options_for("inductor").lift_context is True
    assert (cs.context_hoist_on(compiled=True), cs.context_hoist_on()) == (True, True)
    monkeypatch.setenv(cs.CONTEXT_HOIST_ENV, "yes")  # not a setting: the default
    assert (cs.context_hoist_on(compiled=True), cs.context_hoist_on()) == (True, False)


def test_the_join_is_traced_unless_switched_off_and_the_two_are_kept_apart(monkeypatch):
    """``CNA_COMPILE_TRACED_JOIN`` unset: the UNet's wait for the ControlNets' stream is an op of
    its graph; ``0``: a graph break. The setting is part of the compile settings, so a model's
    graphs and compiled code made with one are never served for the other; TorchCompileModel's
    settings take it from the pack's."""
    monkeypatch.delenv(cs.TRACED_JOIN_ENV, raising=False)
    traced = cs.options_for("inductor")
    assert traced.traced_join is True and cs.traced_join_on()
    monkeypatch.setenv(cs.TRACED_JOIN_ENV, "0")
    untraced = cs.options_for("inductor")
    assert untraced.traced_join is False and untraced != traced
    assert C.options_from_torch_compile({"backend": "inductor"}, untraced)[0].traced_join is False
    monkeypatch.setenv(cs.TRACED_JOIN_ENV, "1")
    assert cs.options_for("inductor") == traced


def test_torch_compile_model_is_adopted_and_its_wrapper_left_out_of_the_run(allocator):
    allocator("native")
    opts = _tcm_options()
    run, why = cs.begin_run(None, opts, torch.nn.Linear(2, 2))
    assert why is None and run.source == "TorchCompileModel"
    assert run.options.mode == "max-autotune-no-cudagraphs"  # inductor's CUDA graphs stay off
    assert cs.TORCH_COMPILE_KEY not in opts["transformer_options"]["wrappers"]["apply_model"]


def test_an_adopted_torch_compile_model_gets_the_pack_s_compile_switches(allocator, monkeypatch):
    """The settings of a model from TorchCompileModel start from compiled mode's own, so the
    environment switches (the attention choice, dynamic shapes, the GEGLU rewrite) apply to it
    as to the node's ``compile`` choice; its own mode still wins."""
    from comfyui_controlnet_accelerator.kernels import attention_choice, fx_rewrites

    allocator("native")
    monkeypatch.setenv(fx_rewrites.GEGLU_ENV, "1")
    monkeypatch.delenv(cs.DYNAMIC_ENV, raising=False)
    monkeypatch.setenv(attention_choice.ENV, "fastest")
    run, _ = cs.begin_run(None, _tcm_options(), torch.nn.Linear(2, 2))
    passes = run.options.graph_passes
    assert passes == (fx_rewrites.GegluRewrite(), cs.ATTENTION_CHOICE), passes
    monkeypatch.delenv(fx_rewrites.GEGLU_ENV)
    monkeypatch.setenv(attention_choice.ENV, "off")
    monkeypatch.setenv(cs.DYNAMIC_ENV, "1")
    run, _ = cs.begin_run(None, _tcm_options(), torch.nn.Linear(2, 2))  # its dynamic: None
    assert run.options.graph_passes == () and run.options.dynamic == "dynamic"
    assert run.options.mode == "max-autotune-no-cudagraphs"
    opts = _tcm_options()
    opts[cs.TORCH_COMPILE_KWARGS]["dynamic"] = False
    run, _ = cs.begin_run(None, opts, torch.nn.Linear(2, 2))
    assert run.options.dynamic == "static"


def test_cuda_malloc_async_refuses_with_the_fix_and_keeps_torch_compile_model(allocator):
    allocator("cudaMallocAsync")
    opts = _tcm_options()
    run, why = cs.begin_run(CompileOptions(), opts, torch.nn.Linear(2, 2))
    assert run is None and "--disable-cuda-malloc" in why
    assert cs.COMPILE_RUN_KEY not in opts["transformer_options"]
    # nothing of the user's setup is dropped when compiled mode cannot run
    assert cs.TORCH_COMPILE_KEY in opts["transformer_options"]["wrappers"]["apply_model"]


def test_backend_override_for_checking_a_machine(monkeypatch):
    assert cs.options_for("off") is None
    assert cs.options_for("inductor").backend == "inductor"
    monkeypatch.setenv(cs.BACKEND_ENV, "aot_eager")
    assert cs.options_for("inductor max-autotune").backend == "aot_eager"
    monkeypatch.setenv(cs.BACKEND_ENV, "tensorrt")
    with pytest.raises(ValueError, match="backend"):
        cs.options_for("inductor")


def test_compiled_net_forwards_attributes_and_calls():
    net = torch.nn.Linear(3, 2)
    calls = []

    class FakeCompiled:
        target = net

        def __call__(self, *a, **k):
            calls.append(a)
            return net(*a, **k)

    stand_in = cs.CompiledNet(FakeCompiled())
    assert stand_in.weight is net.weight and stand_in.out_features == 2
    x = torch.randn(1, 3)
    assert torch.equal(stand_in(x), net(x)) and len(calls) == 1
