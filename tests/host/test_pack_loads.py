# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack loads through ComfyUI's own custom-node loader and its node schemas validate."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.host


def test_pack_loads_through_comfyui_loader(host):
    mod = sys.modules[host.pack_module_name]
    assert mod.WEB_DIRECTORY == "./web"
    import nodes

    # The V3 entry point was called: every node it lists is registered under our prefix.
    ext_nodes = mod.LOADED_NODE_IDS
    for node_id in ext_nodes:
        assert node_id.startswith("CNA_"), node_id
        assert node_id in nodes.NODE_CLASS_MAPPINGS
    assert any(p.endswith("web") for p in nodes.EXTENSION_WEB_DIRS.values())


def test_entry_point_returns_extension_with_node_list(host):
    import asyncio

    from comfy_api.latest import ComfyExtension

    mod = sys.modules[host.pack_module_name]
    ext = asyncio.run(mod.comfy_entrypoint())
    assert isinstance(ext, ComfyExtension)
    listed = asyncio.run(ext.get_node_list())
    assert sorted(c.define_schema().node_id for c in listed) == sorted(mod.LOADED_NODE_IDS)


def test_every_node_schema_validates(host):
    import asyncio

    mod = sys.modules[host.pack_module_name]
    ext = asyncio.run(mod.comfy_entrypoint())
    for cls in asyncio.run(ext.get_node_list()):
        schema = cls.define_schema()
        schema.validate()
        assert schema.node_id.startswith("CNA_")
        assert schema.category.startswith("ControlNet Accelerator")
        assert schema.display_name and schema.description
        for inp in schema.inputs:
            assert getattr(inp, "tooltip", None), f"{schema.node_id}.{inp.id} has no tooltip"
        # ComfyUI's own V1 view of the node (what /object_info serves) must build too.
        info = cls.GET_NODE_INFO_V1()
        assert info["category"] == schema.category


def test_pyproject_parses_with_comfyui_config_parser(host):
    pytest.importorskip(
        "pydantic_settings", reason="ComfyUI's comfy_config needs pydantic-settings"
    )
    from comfy_config import config_parser
    from comfyui_controlnet_accelerator.harness.comfy_host import PACK_ROOT

    cfg = config_parser.extract_node_configuration(str(PACK_ROOT))
    assert cfg is not None
    assert cfg.project.name == "comfyui-controlnet-accelerator"
    assert cfg.tool_comfy.publisher_id
    assert cfg.tool_comfy.display_name
    assert cfg.project.supported_comfyui_version.startswith(">=")


def test_nodes_md_documents_every_node_and_input(host):
    import asyncio

    from comfyui_controlnet_accelerator.harness.comfy_host import PACK_ROOT

    doc = (PACK_ROOT / "NODES.md").read_text(encoding="utf-8")
    mod = sys.modules[host.pack_module_name]
    ext = asyncio.run(mod.comfy_entrypoint())
    for cls in asyncio.run(ext.get_node_list()):
        schema = cls.define_schema()
        assert f"`{schema.node_id}`" in doc, f"NODES.md lacks {schema.node_id}"
        section = doc.split(f"`{schema.node_id}`", 1)[1].split("\n## ", 1)[0]
        for inp in schema.inputs:
            assert f"`{inp.id}`" in section, f"NODES.md: {schema.node_id} lacks input {inp.id}"
