# SPDX-License-Identifier: GPL-3.0-or-later
"""The benchmark's variants against the nodes ComfyUI loaded: an input a node does not declare
(a variant written for a newer version of a node) is named before anything runs."""

from __future__ import annotations

import pytest
from comfyui_controlnet_accelerator.harness import quick
from comfyui_controlnet_accelerator.harness import workflows as wf

pytestmark = pytest.mark.host

# Inputs the loaded nodes may not have yet: the CUDA Graph node's compiled mode.
NEWER = {
    v: "'compile'"
    for v in (
        "graph_compiled",
        "fused+graph_compiled",
        "graph_compiled_geglu_kernel",
        "graph_compiled_geglu_kernel_serial",
        "graph_compiled_dynamic",
        "graph_compiled_attention",
        "graph_compiled_comfy_attention",
        "graph_compiled_autotune",
        "graph_compiled_tuned",
        "graph_compiled_serial",
        "graph_compiled_nested",
        "graph_compiled_untraced_join",
    )
}


def test_every_variant_gives_its_nodes_only_inputs_they_declare(host):
    for name, extra in quick.VARIANTS.items():
        p, _ = wf.build_prompt(wf.WORKLOADS["T2"], 0, ["a.png", "b.png"], extra)
        unknown = quick.unknown_inputs(p)
        if name in NEWER:
            assert all(NEWER[name] in u for u in unknown), (name, unknown)
        else:
            assert not unknown, (name, unknown)


def test_an_undeclared_input_is_named_with_its_node(host):
    extra = quick._insert_model_node("CNA_CUDAGraph", enabled=True, bogus_option=3)
    p, _ = wf.build_prompt(wf.WORKLOADS["T1"], 0, ["a.png"], extra)
    assert quick.unknown_inputs(p) == ["CNA_CUDAGraph has no input 'bogus_option' in this version"]
