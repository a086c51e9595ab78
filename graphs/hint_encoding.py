# SPDX-License-Identifier: GPL-3.0-or-later
"""A ControlNet's hint encoder, taken out of the step's graph.

An SD/SDXL ControlNet runs its hint encoder (``input_hint_block``: convolutions and SiLU at the
hint image's full resolution, 512² for SD1.5 at 512², 1024² for SDXL at 1024²) at every call,
and its output depends on the hint image alone: not on the latent, the timestep or the prompt.
Inside a graph it would run again at every replay. Here it runs once instead, outside the graph,
into a buffer the graph reads; the graph runs the network with the encoder replaced by that
buffer. The arithmetic is the same (the encoder is the same module on the same input, run
before the rest of the network as it is inside the forward), so the result is too.

- ``encoder_of(net)``: the encoder, when taking it out is exact: a sequence of ``Conv2d`` and
  ``SiLU`` layers (so no timestep or prompt reaches it), on a network without a control-type
  embedding (a Union ControlNet mixes the timestep into its hint). Else None.
- ``EncodedHintNet(net)``: stands in for the network while a graph's function runs. Called with
  the hint it was given an encoding for (``use``), it runs a shallow copy of the network whose
  encoder hands that encoding through; any other hint (a caller that sliced the batch, say)
  runs the whole network, as before. Attribute reads reach the real network. In compiled mode
  ``inner`` is set to a compiled copy of the headless network, and ``whole`` to a function that
  gives one of the whole network (called only when a call needs it); None runs them eager.

Plain PyTorch: nothing here imports ComfyUI. The network is held weakly.
"""

from __future__ import annotations

import weakref

import torch

ENCODER_ATTR = "input_hint_block"
UNION_ATTR = "control_add_embedding"  # Union ControlNets: control type mixed into the timestep
_LAYERS = (torch.nn.Conv2d, torch.nn.SiLU)


def encoder_of(net) -> torch.nn.Module | None:
    """``net``'s hint encoder if it can run once per hint, else None."""
    if not isinstance(net, torch.nn.Module) or getattr(net, UNION_ATTR, None) is not None:
        return None
    enc = net._modules.get(ENCODER_ATTR)
    if not isinstance(enc, torch.nn.Sequential) or len(enc) == 0:
        return None
    if not all(isinstance(layer, _LAYERS) for layer in enc):
        return None
    if enc._forward_hooks or enc._forward_pre_hooks:
        return None
    return enc


def encode(encoder: torch.nn.Module, hint: torch.Tensor) -> torch.Tensor:
    """The encoder on ``hint``, called as the network's forward calls it (no timestep embedding
    or prompt reaches these layers)."""
    return encoder(hint, None, None)


class _Encoded(torch.nn.Module):
    """The headless network's encoder: hands through what it is given (already encoded)."""

    def forward(self, hint, *args, **kwargs):
        return hint


def with_encoder(net: torch.nn.Module, encoder: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``net`` (same class, same layers and weights, not copied) whose hint
    encoder is ``encoder``; ``net`` itself is left as it is."""
    view = type(net).__new__(type(net))
    view.__dict__.update(net.__dict__)
    view._modules = dict(net._modules)
    view._modules[ENCODER_ATTR] = encoder
    view._parameters = dict(net._parameters)
    view._buffers = dict(net._buffers)
    return view


def _headless(net: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of ``net`` whose encoder hands its input through."""
    return with_encoder(net, _Encoded())


def same_layers(view: torch.nn.Module, net: torch.nn.Module) -> bool:
    """Whether ``view`` (made by ``with_encoder``) still shares every layer, parameter and
    buffer of ``net`` but the encoder (a patch that replaced one of the network's direct
    children makes a new copy)."""
    for name in ("_modules", "_parameters", "_buffers"):
        a, b = view.__dict__[name], net.__dict__[name]
        if a.keys() != b.keys():
            return False
        for k, v in b.items():
            if k != ENCODER_ATTR and a[k] is not v:
                return False
    return True


class EncodedHintNet:
    """Stands in for a ControlNet's network while a graph's function runs (see the module
    docstring). Stable per network: callers may key their own state by it."""

    def __init__(self, net: torch.nn.Module):
        self.__dict__.update(
            _ref=weakref.ref(net),
            _view=_headless(net),
            _hint=None,  # the tensor the encoding is of
            _encoded=None,
            inner=None,  # what runs the headless network (None: the copy itself)
            whole=None,  # network -> what runs it whole, for any other hint (None: itself)
            encoded_calls=0,
            full_calls=0,
        )

    @property
    def real(self) -> torch.nn.Module | None:
        return self.__dict__["_ref"]()

    @property
    def headless(self) -> torch.nn.Module:
        """The network without its encoder; a new copy if the network's layers were replaced
        since (then ``inner`` is cleared: a compiled copy of the old one no longer applies)."""
        net = self.real
        view = self.__dict__["_view"]
        if net is not None and not same_layers(view, net):
            view = self.__dict__["_view"] = _headless(net)
            self.__dict__["inner"] = None
        return view

    def use(self, hint: torch.Tensor | None, encoded: torch.Tensor | None) -> None:
        """Calls with ``hint`` (this very tensor) read ``encoded``; None clears it."""
        self.__dict__["_hint"] = hint
        self.__dict__["_encoded"] = encoded

    def __getattr__(self, name):
        net = self.__dict__["_ref"]()
        if net is None:
            raise AttributeError(name)
        return getattr(net, name)

    def __setattr__(self, name, value):
        if name in ("inner", "whole"):
            self.__dict__[name] = value
        else:
            raise AttributeError(f"EncodedHintNet is read-only ({name})")

    def __call__(self, *args, **kwargs):
        d = self.__dict__
        if "hint" in kwargs:
            hint = kwargs["hint"]
        elif len(args) > 1:
            hint = args[1]
        else:
            hint = None
        if d["_encoded"] is None or hint is None or hint is not d["_hint"]:
            net = self.real
            if net is None:
                raise RuntimeError("EncodedHintNet: the network is gone")
            d["full_calls"] += 1
            run = net if d["whole"] is None else d["whole"](net)
            return run(*args, **kwargs)
        if "hint" in kwargs:
            kwargs = {**kwargs, "hint": d["_encoded"]}
        else:
            args = (args[0], d["_encoded"], *args[2:])
        d["encoded_calls"] += 1
        headless = self.headless
        run = d["inner"] if d["inner"] is not None else headless
        return run(*args, **kwargs)
