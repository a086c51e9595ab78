# SPDX-License-Identifier: GPL-3.0-or-later
"""Every combo input of every node is checked before the node does anything, on every ComfyUI
version, through ComfyUI's real validation and executor.

- A widget value not in the list is refused by ``/prompt`` validation (``validate_prompt``), with
  the pack's node / input / fix message: ComfyUI 0.3.x does not check V3 combo values itself,
  newer versions do but leave inputs a node validates to the node, so the message is the same.
- A value that arrives through a link is only known when the node runs: ``execute`` refuses it
  first thing, and ComfyUI reports ``controlnet_accelerator.NodeInputError`` as its type.

Run with COMFYUI_PATH pointing at another ComfyUI tree to check that version.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from comfyui_controlnet_accelerator.harness import runner
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.quick import VARIANTS, _feature_cache

pytestmark = [pytest.mark.host, pytest.mark.usefixtures("graph_backend")]

T1 = wf.WORKLOADS["T1"].with_(steps=2)


def _graph_sampler(p: dict, ids: dict) -> None:
    node = p[ids["sampler"]]
    node["class_type"] = "CNA_KSamplerCUDAGraph"
    node["inputs"].update(enabled=True, max_graphs=8, verify=False)


# (node's class_type, its display name, the variant that puts it in the prompt, combo inputs)
NODES = {
    "ksampler_graph": (
        "CNA_KSamplerCUDAGraph",
        "KSampler (CUDA Graph)",
        _graph_sampler,
        ["sampler_name", "scheduler", "compile"],
    ),
    "cuda_graph": ("CNA_CUDAGraph", "CUDA Graph", VARIANTS["cuda_graph"], ["compile"]),
    "memory_pool": (
        "CNA_ControlNetMemoryPool",
        "ControlNet Memory Pool",
        VARIANTS["pool_int8"],
        ["unet_weights", "controlnet_weights"],
    ),
    "feature_cache": (
        "CNA_ControlNetFeatureCache",
        "ControlNet Feature Cache",
        _feature_cache(mode="every_n", every_n=2, max_reuse=1),
        ["mode", "storage"],
    ),
}
CASES = [(node, name) for node, (_, _, _, names) in NODES.items() for name in names]
IDS = [f"{node}-{name}" for node, name in CASES]


def _prompt(variant) -> dict:
    import folder_paths

    hints = wf.write_hint_images(folder_paths.get_input_directory(), T1)
    return wf.build_prompt(T1, 3, hints, variant)


def _validate(p: dict):
    import execution

    return asyncio.run(execution.validate_prompt(str(uuid.uuid4()), p, None))


def _node_id(p: dict, class_type: str) -> str:
    (nid,) = [k for k, v in p.items() if v["class_type"] == class_type]
    return nid


def runner_pack(host):
    import sys

    return sys.modules[host.pack_module_name]


def test_the_cases_cover_every_combo_of_every_node(host):
    """A new combo input on any node must be added to this file's cases."""
    pack = runner_pack(host)
    combos = {
        (cls.define_schema().node_id, inp.id)
        for cls in pack.nodes.extension.node_classes()
        for inp in cls.define_schema().inputs
        if inp.get_io_type() == "COMBO"
    }
    covered = {(NODES[node][0], name) for node, name in CASES}
    assert combos == covered


@pytest.mark.parametrize("node, name", CASES, ids=IDS)
def test_a_widget_value_not_in_the_list_is_refused_at_validation(host, tiny_models, node, name):
    class_type, display, variant, _ = NODES[node]
    p, _ = _prompt(variant)
    nid = _node_id(p, class_type)
    ok, _, _, node_errors = _validate(p)
    assert ok, node_errors  # the unchanged prompt is valid

    p[nid]["inputs"][name] = "bogus"
    ok, err, _, node_errors = _validate(p)
    assert not ok
    assert list(node_errors) == [nid], node_errors
    # ComfyUI files the node's answer under each input it validates: one message, repeated
    errors = node_errors[nid]["errors"]
    assert errors and all(e["type"] == "custom_validation_failed" for e in errors), errors
    for e in errors:
        assert f"{display}: input '{name}' is 'bogus', not one of its choices." in e["details"]
        assert "Choose one of" in e["details"]
    with pytest.raises(runner.WorkflowFailed, match="does not validate"):
        runner.Runner().run(p, {"sampler": nid})


def test_a_sampler_typo_names_the_nearest_sampler(host, tiny_models):
    p, ids = _prompt(_graph_sampler)
    p[ids["sampler"]]["inputs"]["sampler_name"] = "eulr"
    _, _, _, node_errors = _validate(p)
    errors = node_errors[ids["sampler"]]["errors"]
    assert errors and all("Did you mean 'euler'" in e["details"] for e in errors), errors


def _combo_source(monkeypatch, value: str) -> str:
    """A test-only node that outputs ``value`` as a COMBO, as a primitive or switch node of
    another pack would: the link carries a value ComfyUI's validation never sees."""
    import nodes

    class ComboSource:
        RETURN_TYPES = ("COMBO",)
        FUNCTION = "run"
        CATEGORY = "testing"

        @classmethod
        def INPUT_TYPES(cls):  # noqa: N802 (ComfyUI's name)
            return {"required": {}}

        def run(self):
            return (value,)

    monkeypatch.setitem(nodes.NODE_CLASS_MAPPINGS, "CNATest_ComboSource", ComboSource)
    return "CNATest_ComboSource"


@pytest.mark.parametrize("node, name", CASES, ids=IDS)
def test_a_linked_value_not_in_the_list_is_refused_when_the_node_runs(
    host, tiny_models, monkeypatch, node, name
):
    class_type, display, variant, _ = NODES[node]
    p, ids = _prompt(variant)
    nid = _node_id(p, class_type)
    p["900"] = {"class_type": _combo_source(monkeypatch, "bogus"), "inputs": {}}
    p[nid]["inputs"][name] = ["900", 0]
    ok, _, _, node_errors = _validate(p)
    assert ok, node_errors  # links pass validation
    steps: list[int] = []
    with pytest.raises(runner.WorkflowFailed) as e:
        runner.Runner().run(p, ids, on_step=steps.append)
    msg = str(e.value)
    assert f"node {nid} ({class_type}) failed: controlnet_accelerator.NodeInputError: " in msg
    assert f"{display}: input '{name}' is 'bogus', not one of its choices." in msg
    assert steps == []  # refused before sampling started (a bad sampler name once ran as euler)


def test_a_linked_valid_value_runs(host, tiny_models, monkeypatch):
    p, ids = _prompt(_graph_sampler)
    p["900"] = {"class_type": _combo_source(monkeypatch, "euler"), "inputs": {}}
    p[ids["sampler"]]["inputs"]["sampler_name"] = ["900", 0]
    res = runner.Runner().run(p, ids)
    assert res.latent.shape[-2:] == (T1.height // 8, T1.width // 8)


def test_the_exception_type_is_a_plain_name(host):
    """ComfyUI builds ``exception_type`` from the class's module and name (execution.py,
    ``full_type_name``); the pack's module is named after its folder, a file path."""
    import execution

    pack = runner_pack(host)
    for cls in (pack.errors.NodeInputError, pack.errors.ControlNetAcceleratorError):
        name = execution.full_type_name(cls)
        assert name == f"controlnet_accelerator.{cls.__name__}"
        assert pack.__name__ not in name
