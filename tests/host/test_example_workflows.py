# SPDX-License-Identifier: GPL-3.0-or-later
"""The shipped example workflows are valid UI graphs of real nodes, match their generator, and
run end to end (on the tiny models, with the user's model names swapped for ours)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from comfyui_controlnet_accelerator.harness import examples, runner, ui_workflow
from comfyui_controlnet_accelerator.harness import workflows as wf
from comfyui_controlnet_accelerator.harness.random_models import SPECS

pytestmark = pytest.mark.host
ROOT = Path(__file__).resolve().parents[2]
FILES = sorted((ROOT / "example_workflows").glob("*.json"))


def _linked_outputs(ui: dict) -> dict:
    """The graph with each node's unlinked output slots left out: newer ComfyUI releases add
    outputs to stock nodes (0.33's SaveImage returns its images), which the shipped files,
    written against the oldest supported release, do not list. Linked slots keep their place."""
    out = json.loads(json.dumps(ui))
    for node in out["nodes"]:
        node["outputs"] = [o for o in node.get("outputs", []) if o.get("links")]
    return out


def test_there_are_examples():
    assert {p.stem for p in FILES} == set(examples.EXAMPLES)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_example_is_a_consistent_ui_graph(host, path):
    ui = json.loads(path.read_text())
    nodes = {n["id"]: n for n in ui["nodes"]}
    for lk in ui["links"]:
        link_id, src, slot, dst, dslot, typ = lk
        assert nodes[src]["outputs"][slot]["type"] == typ
        assert link_id in nodes[src]["outputs"][slot]["links"]
        assert nodes[dst]["inputs"][dslot]["link"] == link_id
        assert nodes[dst]["inputs"][dslot]["type"] == typ
    api = ui_workflow.ui_to_api(ui)  # raises on unknown nodes or widget mismatches
    again = ui_workflow.api_to_ui(
        api, {str(n["id"]): n["title"] for n in ui["nodes"] if "title" in n}
    )
    assert _linked_outputs(again) == _linked_outputs(ui)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_example_matches_its_generator(host, path):
    prompt, titles = examples.EXAMPLES[path.stem]()
    generated = _linked_outputs(ui_workflow.api_to_ui(prompt, titles))
    assert _linked_outputs(json.loads(path.read_text())) == generated, (
        "example_workflows/ is stale: run python tools/make_examples.py"
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_example_runs_on_tiny_models(host, tiny_models, path, monkeypatch):
    import folder_paths

    if host.cpu:
        monkeypatch.setenv("CNA_GRAPH_BACKEND", "emulate")
    api = ui_workflow.ui_to_api(json.loads(path.read_text()))
    hint = wf.write_hint_images(folder_paths.get_input_directory(), wf.WORKLOADS["T1"])[0]
    nets = iter([SPECS["sd15-tiny-cn-a"].filename, SPECS["sd15-tiny-cn-b"].filename])
    ids = {}
    for nid, node in api.items():
        ins, ct = node["inputs"], node["class_type"]
        if ct == "CheckpointLoaderSimple":
            ins["ckpt_name"] = SPECS["sd15-tiny"].filename
        elif ct == "ControlNetLoader":
            ins["control_net_name"] = next(nets)
        elif ct == "LoadImage":
            ins["image"] = hint
        elif ct == "EmptyLatentImage":
            ins["width"] = ins["height"] = 64
        elif ct in ("KSampler", "CNA_KSamplerCUDAGraph"):
            ins["steps"] = 4
            ids["sampler"] = nid
        elif ct == "VAEDecode":
            ids["decode"] = nid
            ids.setdefault("decodes", []).append(nid)
        elif ct == "SaveImage":
            node["class_type"] = "PreviewImage"  # keep the test's output folder clean
            ins.pop("filename_prefix")
    status = sys.modules[host.pack_module_name].nodes.status
    status.LAST.clear()
    r = runner.Runner()
    res = r.run(api, ids)
    assert res.image is not None and res.image.shape == (1, 64, 64, 3)
    assert torch.isfinite(res.image).all()
    if "stock_vs_accelerated" in path.name:  # both branches: the same picture
        stock_img, fast_img = (r.output_of(d)[0] for d in ids["decodes"])
        assert torch.equal(stock_img, fast_img)
    # every node of ours reported its run for the front end's badge, with figures in it; under
    # DynamicVRAM (ComfyUI 0.33 on a GPU) the graph nodes run classic copies and say so, or,
    # where none can be had, pass the model on and say why
    ours = {nid: n["class_type"] for nid, n in api.items() if n["class_type"].startswith("CNA_")}
    assert ours
    for nid, ct in ours.items():
        got = status.LAST.get(str(nid))
        assert got is not None, f"{ct} (node {nid}) sent no badge"
        text = " ".join(got["lines"])
        if host.dynamic_vram and got.get("kind") == "cuda_graph":
            if "passed_through" in got["data"]:
                assert "DynamicVRAM" in text, got
                continue
            assert got["data"].get("classic_copies") is True, got
        assert got["lines"] and any(ch.isdigit() for ch in text), got


def test_a_workflow_saved_before_a_widget_existed_gets_its_default(host):
    """A graph saved before the CUDA Graph node had its ``compile`` widget loads as the front end
    loads it: the missing trailing widget takes its default."""
    path = next(p for p in FILES if p.stem == "controlnet_sd15_cuda_graph")
    ui = json.loads(path.read_text())
    node = next(n for n in ui["nodes"] if n["type"] == "CNA_CUDAGraph")
    assert node["widgets_values"][-1] == "off"
    node["widgets_values"] = node["widgets_values"][:-1]
    api = ui_workflow.ui_to_api(ui)
    assert api[str(node["id"])]["inputs"]["compile"] == "off"
    assert api[str(node["id"])]["inputs"]["max_graphs"] == node["widgets_values"][1]
