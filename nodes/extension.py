# SPDX-License-Identifier: GPL-3.0-or-later
"""The V3 extension object that ComfyUI asks for the pack's node list."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension, io

from ..logger import logger


def node_classes() -> list[type[io.ComfyNode]]:
    """Every node the pack registers, in the order ComfyUI's search shows them."""
    from .nodes_cuda_graph import NODES as GRAPH_NODES
    from .nodes_feature_cache import NODES as CACHE_NODES
    from .nodes_fused_apply import NODES as FUSED_NODES
    from .nodes_memory_pool import NODES as POOL_NODES

    return [*FUSED_NODES, *CACHE_NODES, *POOL_NODES, *GRAPH_NODES]


class ControlNetAcceleratorExtension(ComfyExtension):
    async def on_load(self) -> None:
        logger.debug("ControlNet Accelerator extension loaded")

    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return node_classes()
