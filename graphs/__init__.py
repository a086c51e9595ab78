# SPDX-License-Identifier: GPL-3.0-or-later
"""CUDA-graph capture with static buffers, an LRU of graphs and remembered fallbacks.

Plain PyTorch, no ComfyUI import: the ComfyUI glue lives in ``nodes/cuda_graph.py``.
"""

from .static_graph import CaptureFailed, GraphCache, GraphEntry, backend_name

__all__ = ["CaptureFailed", "GraphCache", "GraphEntry", "backend_name"]
