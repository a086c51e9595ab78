# SPDX-License-Identifier: GPL-3.0-or-later
"""Which nodes build the pack's CUDA kernels ahead of sampling (``nodes/kernel_build.py``):
those whose steps will use them, with the settings that use them. The build itself, its
progress bar and its place before the first step: tests/host/test_fused_apply.py and
tests/kernels/test_build_faults.py."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.host


def test_cache_and_pool_build_the_kernels_only_for_their_int8_settings(host, monkeypatch):
    nodes = sys.modules[host.pack_module_name].nodes
    fc, mp = nodes.nodes_feature_cache, nodes.nodes_memory_pool
    asked = []
    for m in (fc, mp):
        monkeypatch.setattr(m, "build_kernels", lambda node_id=None: asked.append(node_id))
    monkeypatch.setattr(fc, "apply_cache", lambda cn, cfg, node_id=None: cn)
    monkeypatch.setattr(mp, "apply_memory_pool", lambda m, cn, opts, node_id=None: (m, cn))
    cache, pool = fc.ControlNetFeatureCache, mp.ControlNetMemoryPool

    cases = [
        (lambda: cache.execute("cn", mode="every_n", storage="int8"), True),
        (lambda: cache.execute("cn", mode="adaptive", storage="int8"), True),
        (lambda: cache.execute("cn", mode="every_n", storage="fp16"), False),
        (lambda: cache.execute("cn", mode="off", storage="int8"), False),
        (lambda: pool.execute("model", None, "int8", "as loaded"), True),
        (lambda: pool.execute("model", "cn", "as loaded", "int8"), True),
        (lambda: pool.execute("model", "cn", "stream", "as loaded"), False),
        (lambda: pool.execute("model", "cn", "as loaded", "as loaded"), False),
    ]
    for i, (run, builds) in enumerate(cases):
        asked.clear()
        run()
        assert len(asked) == int(builds), i


def test_nothing_is_built_where_comfyui_does_not_run_on_cuda(host, monkeypatch):
    pack = sys.modules[host.pack_module_name]
    kb = pack.nodes.kernel_build
    asked = []
    monkeypatch.setattr(kb.kernels, "prepare_cuda", lambda on_progress=None: asked.append(1))
    monkeypatch.setattr(kb, "_comfy_on_cuda", lambda: False)  # as with --cpu on a GPU machine
    assert kb.build_kernels("7") is False and asked == []
    monkeypatch.setattr(kb, "_comfy_on_cuda", lambda: True)
    kb.build_kernels("7")
    assert asked == [1]
    if host.cpu:  # ComfyUI's own device, unpatched
        monkeypatch.undo()
        import comfy.model_management

        assert comfy.model_management.get_torch_device().type == "cpu"
        assert kb._comfy_on_cuda() is False
