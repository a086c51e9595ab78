# SPDX-License-Identifier: GPL-3.0-or-later
"""Deferring the ControlNet call to the UNet call, for the CUDA Graph wrapper.

ComfyUI runs each control object's ``get_control`` in ``calc_cond_batch`` and hands the residual
dict to ``apply_model``. The graph wrapper needs both in one function, so its CALC_COND_BATCH
wrapper swaps each control object in the conds for a memoised ``_DeferredControl`` (cond and
uncond still batch together: ComfyUI batches on ``control is control``) whose ``get_control``
only records the call as a ``ControlCall``; the APPLY_MODEL wrapper receives that record with
the UNet's inputs. ``_JoinOnUse`` is the residual dict of ControlNets that ran on a side stream.
"""

from __future__ import annotations

import torch

from ..graphs import stream_join


class _DeferredControl:
    """Stands in for a control object inside one ``calc_cond_batch`` call."""

    __slots__ = ("control",)

    def __init__(self, control):
        self.control = control

    def get_control(self, x_noisy, t, cond, batched_number, transformer_options):
        return ControlCall(self.control, x_noisy, t, cond, batched_number, transformer_options)


def defer_controls(conds: list) -> list:
    """``conds`` with each control object replaced by one ``_DeferredControl`` per object."""
    proxies: dict[int, _DeferredControl] = {}
    new_conds = []
    for cond_list in conds:
        if cond_list is None:
            new_conds.append(None)
            continue
        out = []
        for d in cond_list:
            ctrl = d.get("control") if isinstance(d, dict) else None
            if ctrl is not None:
                p = proxies.get(id(ctrl))
                if p is None:
                    p = proxies[id(ctrl)] = _DeferredControl(ctrl)
                d = dict(d)
                d["control"] = p
            out.append(d)
        new_conds.append(out)
    return new_conds


class ControlCall:
    """A recorded ``control.get_control(...)``; resolves to ComfyUI's residual dict on demand.

    It also behaves as that dict (resolving on first use), so code that reaches the UNet without
    our APPLY_MODEL wrapper in between still gets exactly what stock ComfyUI would give it.
    """

    def __init__(self, control, x_noisy, t, cond, batched_number, transformer_options):
        self.control = control
        self.args = (x_noisy, t, cond, batched_number, transformer_options)
        self._resolved = None
        self._done = False

    def with_options(self, transformer_options: dict) -> None:
        """Resolve (if it comes to that) with these transformer_options instead."""
        self.args = (*self.args[:4], transformer_options)

    def resolve(self):
        if not self._done:
            self._resolved = self.control.get_control(*self.args)
            self._done = True
        return self._resolved

    # dict protocol, as used by openaimodel.apply_control and friends
    def __contains__(self, k):
        r = self.resolve()
        return r is not None and k in r

    def __getitem__(self, k):
        return self.resolve()[k]

    def get(self, k, default=None):
        r = self.resolve()
        return default if r is None else r.get(k, default)

    def keys(self):
        return (self.resolve() or {}).keys()

    def items(self):
        return (self.resolve() or {}).items()


def join_stream(residuals: _JoinOnUse) -> None:
    """The current stream waits for the event recorded after the ControlNets' side-stream work."""
    torch.cuda.current_stream().wait_event(residuals.event)


def traced_join(residuals: _JoinOnUse) -> torch.Tensor | None:
    """The join as an op of the compiled graph (graphs/stream_join.py): it makes the wait that
    ``stream_join.waiting`` set for the UNet's call, and returns the one that gates the
    residuals. Dynamo traces this function, so the UNet compiles as one graph. A dict with no
    tensor (only None entries) has nothing to gate: None, and the stream is joined after the
    UNet as always."""
    tensors = residual_tensors(residuals, join=False)
    return stream_join.gate(tensors[0]) if tensors else None


class _JoinOnUse(dict):
    """The residual dict of ControlNets that ran on a side stream. The UNet's stream waits for
    the side stream just before it first reads a residual (an empty list, like the ``input``
    entry of an SD ControlNet, needs no wait), so the input blocks overlap the ControlNets.

    ``wait(residuals)`` makes the wait (default ``join_stream``) and returns None, or a 0-dim
    tensor that every residual is then multiplied by, in place in the dict (``traced_join``:
    a one that carries the wait in compiled code). Compiled mode hands ``traced_join``, or,
    with ``CNA_COMPILE_TRACED_JOIN=0``, a call dynamo never traces
    (``graphs.compiled.untraced``): the UNet's compiled code then breaks where the first
    residual is read, and the wait runs between its parts. Either is handed the dict itself, so
    traced code never reads the event (whose value, new per capture, dynamo would otherwise
    guard on)."""

    def __init__(self, d: dict, event, wait=None):
        super().__init__(d)
        self.event = event
        self._wait = wait if wait is not None else join_stream
        self._joined = False

    def _join(self) -> None:
        if self._joined:
            return
        self._joined = True
        one = self._wait(self)
        if one is None:
            return
        for k, v in dict.items(self):
            if isinstance(v, list):  # in place: ComfyUI pops from these lists
                v[:] = [r if r is None else r * one for r in v]
            elif isinstance(v, tuple):
                dict.__setitem__(self, k, tuple(r if r is None else r * one for r in v))
            elif isinstance(v, torch.Tensor):
                dict.__setitem__(self, k, v * one)

    def __getitem__(self, k):
        v = dict.__getitem__(self, k)
        if v is not None and (not isinstance(v, (list, tuple)) or len(v) > 0):
            self._join()  # something the UNet will read
        return super().__getitem__(k)

    def get(self, k, default=None):
        return self[k] if k in self else default

    def values(self):
        self._join()
        return super().values()

    def items(self):
        self._join()
        return super().items()


def residual_tensors(control: dict, join: bool = True) -> list[torch.Tensor]:
    """Every tensor of a ControlNet residual dict (``{"input": [...], "middle": [...], ...}``);
    ``join=False`` reads a ``_JoinOnUse`` without joining."""
    out = []
    for v in control.values() if join else dict.values(control):
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


class on_stream:
    """``torch.cuda.stream(s)``, or nothing when ``s`` is None."""

    def __init__(self, s):
        self.s = s
        self.ctx = None

    def __enter__(self):
        if self.s is not None:
            self.ctx = torch.cuda.stream(self.s)
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
