# SPDX-License-Identifier: GPL-3.0-or-later
"""A wait for another CUDA stream that compiled code keeps inside its graph.

The ControlNets can run on a side stream beside the UNet's input blocks; the UNet's stream
must wait for them before it first reads a residual. Made as a plain Python call, that wait
splits the UNet's compiled code into parts (a graph break), and dynamo traces the UNet's
enclosing frames again at each one: the larger part of a warm restart's time at SDXL.

``gate(like)`` is a ``torch.library`` op that dynamo and inductor keep in the graph. When it
runs, it makes the wait that ``waiting(wait)`` set for the call in progress, and returns a
0-dim one of ``like``'s dtype. The caller multiplies each residual by it: ``r * 1`` is ``r``
bit for bit, and inductor fuses the product into the add that reads the residual, so every
read of a residual depends on the wait, and the wait on nothing else. Inductor keeps an op
whose inputs are all graph inputs where the traced program put it unless it reorders the
graph for peak memory: ``ORDER_OPTIONS`` turns that reordering off for a graph that holds
the op (``holds``: the UNet's; graphs/compiled.py adds them), so the wait stays just before
the first residual is read.

The wait travels in a context variable set for the length of one call (``waiting``), never in
the graph: an event is new at every capture, and a graph that held it would be compiled again
for each. The op is defined once per import of this module (the pack can be imported under
two names), each with its own context variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator

import torch

# inductor settings for a graph that holds the op: keep the traced program's order
ORDER_OPTIONS: tuple[tuple[str, object], ...] = (("reorder_for_peak_memory", False),)

_WAIT: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "stream_join_wait", default=None
)
_NAMESPACE = "cna_join_" + re.sub(r"\W", "_", __name__)


class JoinOutsideCall(RuntimeError):
    """The op ran with no wait set: reading the residuals now could race the side stream."""


def _define():
    @torch.library.custom_op(f"{_NAMESPACE}::gate", mutates_args=())
    def gate(like: torch.Tensor) -> torch.Tensor:
        wait = _WAIT.get()
        if wait is None:
            raise JoinOutsideCall(
                "a compiled graph reached its stream join outside the call that set the wait"
            )
        wait()
        return torch.ones((), dtype=like.dtype, device=like.device)

    @gate.register_fake
    def _(like):
        return like.new_empty(())

    return getattr(torch.ops, _NAMESPACE).gate.default


_OP = _define()


def holds(gm: torch.fx.GraphModule) -> bool:
    """Whether a traced graph calls the op (and so needs ``ORDER_OPTIONS``)."""
    return any(
        n.op == "call_function" and n.target in (_OP, _OP.overloadpacket) for n in gm.graph.nodes
    )


def gate(like: torch.Tensor) -> torch.Tensor:
    """Make the wait set by ``waiting`` and return a 0-dim one of ``like``'s dtype and device;
    traced by dynamo as one op of the graph."""
    return _OP(like)


@contextlib.contextmanager
def waiting(wait: Callable[[], None]) -> Iterator[None]:
    """``gate`` makes ``wait()`` while this block runs (the UNet's call)."""
    token = _WAIT.set(wait)
    try:
        yield
    finally:
        _WAIT.reset(token)
