# SPDX-License-Identifier: GPL-3.0-or-later
"""The pack's CUDA kernels built while a node that uses them runs, with ComfyUI's progress bar.

The kernels compile on first use (about a minute on 16 cores, several on two; then cached).
Left to the first op, that happens inside the sampler's first step, where ComfyUI shows
nothing moving. The nodes whose steps use them (*Apply ControlNet (Fused)*, the *ControlNet
Feature Cache* when on, the *ControlNet Memory Pool* with INT8 weights) call ``build_kernels``
when they run instead: the build then shows as that node's progress bar, one step per compiled
source and one for the link, besides the log's line. Where the ops would not use the kernels
(ComfyUI not on a CUDA device, no compiler, ``CNA_KERNELS=eager``) or they are built already,
it does nothing.
It never fails the node: a failed build leaves every op on its PyTorch path, as on first use.
"""

from __future__ import annotations

from .. import kernels
from ..logger import logger


def build_kernels(node_id=None) -> bool:
    """Build (or load) the kernels now if the ops would use them, showing progress on node
    ``node_id`` (the running node's id; None: the node ComfyUI runs). Returns whether they are
    loaded."""
    progress = _progress(node_id)
    try:
        if not _comfy_on_cuda():
            return False  # ComfyUI runs on another device (--cpu): the ops never meet CUDA
        return kernels.prepare_cuda(on_progress=progress)
    except Exception as e:  # never fail the node over the kernels
        logger.debug("kernels not built ahead: %s", e)
        return False


def build_for_if_nodes(node_id=None) -> bool:
    """The *CUDA Graph* nodes with the context projections once per context (compiled mode by
    default, the exact graphs with ``CNA_CONTEXT_HOIST=1``) record CUDA-graph IF nodes, which
    need the extension where torch has none of its own (before 2.12): built here, with the
    node's progress bar, whether or not the numeric kernels are used. Not under cudaMallocAsync,
    where the projections stay in the step. Returns whether the extension is loaded."""
    from ..graphs import static_graph
    from ..kernels import _jit, graph_if, registry

    progress = _progress(node_id)
    try:
        if graph_if._torch_has_if_nodes() or not _comfy_on_cuda():
            return False
        if static_graph._async_allocator():
            return False
        if _jit.is_loaded():
            return True
        if registry._cuda_static_reason() is not None:
            return False
        return _jit.ensure_loaded(on_progress=progress) is not None
    except Exception as e:  # never fail the node over the kernels
        logger.debug("extension not built ahead: %s", e)
        return False


def _progress(node_id):
    """A build's progress callback that shows as node ``node_id``'s progress bar, made on the
    build's first report (a build that is not needed shows none)."""
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            import comfy.utils

            bar = comfy.utils.ProgressBar(total, node_id=node_id)
        bar.update_absolute(done, total)

    return progress


def _comfy_on_cuda() -> bool:
    import comfy.model_management

    return comfy.model_management.get_torch_device().type == "cuda"
