# SPDX-License-Identifier: GPL-3.0-or-later
"""The hint encoder taken out of the graph (graphs/hint_encoding.py), without ComfyUI: which
networks qualify, and that the stand-in gives the network's own result, bit for bit, with the
encoding computed once outside."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from comfyui_controlnet_accelerator.graphs import hint_encoding as he


class _Seq(torch.nn.Sequential):
    """Like ComfyUI's TimestepEmbedSequential: takes (x, emb, context), gives layers only x."""

    def forward(self, x, emb=None, context=None):
        for layer in self:
            x = layer(x)
        return x


class _Net(torch.nn.Module):
    """The shape of an SD ControlNet's forward: hint encoder, then blocks fed the encoding."""

    def __init__(self, union: bool = False, hint_layers=None):
        super().__init__()
        layers = hint_layers or [
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.SiLU(),
            torch.nn.Conv2d(8, 6, 3, padding=1, stride=2),
        ]
        self.input_hint_block = _Seq(*layers)
        self.conv_in = torch.nn.Conv2d(4, 6, 3, padding=1)
        self.time = torch.nn.Linear(1, 6)
        self.out = torch.nn.Conv2d(6, 6, 1)
        self.scale = torch.nn.Parameter(torch.tensor(1.5))
        self.control_add_embedding = torch.nn.Linear(1, 1) if union else None

    def forward(self, x, hint, timesteps, context, y=None, **kwargs):
        emb = self.time(timesteps[:, None])
        guided = self.input_hint_block(hint, emb, context)
        h = self.conv_in(x) + emb[:, :, None, None]
        h += guided
        return {"output": [self.out(h) * self.scale], "middle": [h.mean()]}


def _inputs(seed=0, b=2):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 4, 8, 8, generator=g),
        torch.rand(b, 3, 16, 16, generator=g),
        torch.rand(b, generator=g),
        torch.randn(b, 5, 7, generator=g),
    )


def _equal(a, b):
    return all(torch.equal(p, q) for k in a for p, q in zip(a[k], b[k], strict=True))


def test_which_networks_qualify():
    assert he.encoder_of(_Net()) is not None
    assert he.encoder_of(_Net(union=True)) is None  # the control type mixes in the timestep
    norm = [torch.nn.Conv2d(3, 6, 3, padding=1, stride=2), torch.nn.GroupNorm(2, 6)]
    assert he.encoder_of(_Net(hint_layers=norm)) is None  # only Conv2d and SiLU layers
    hooked = _Net()
    hooked.input_hint_block.register_forward_hook(lambda *a: None)
    assert he.encoder_of(hooked) is None
    no_encoder = _Net()
    del no_encoder.input_hint_block
    assert he.encoder_of(no_encoder) is None
    assert he.encoder_of(object()) is None


@pytest.mark.parametrize("keyword", [True, False])
def test_stand_in_gives_the_networks_result_with_the_encoding_computed_outside(keyword):
    net = _Net()
    x, hint, t, ctx = _inputs()
    want = net(x, hint, t, ctx)
    hn = he.EncodedHintNet(net)
    calls = []
    net.input_hint_block[0].register_forward_hook(lambda *a: calls.append(1))
    enc = he.encode(he.encoder_of(net), hint)
    assert len(calls) == 1
    hn.use(hint, enc)
    for _ in range(3):
        got = hn(x=x, hint=hint, timesteps=t, context=ctx) if keyword else hn(x, hint, t, ctx)
        assert _equal(want, got)
    assert len(calls) == 1, "the encoder must not run again while the encoding is in use"
    assert (hn.encoded_calls, hn.full_calls) == (3, 0)
    # attribute reads reach the real network
    assert hn.conv_in is net.conv_in and hn.scale is net.scale


def test_the_encoding_is_read_not_copied_so_a_refreshed_buffer_is_seen():
    """A graph holds the buffer's address: refreshing it in place must change the result."""
    net = _Net()
    x, hint, t, ctx = _inputs()
    _, hint2, _, _ = _inputs(seed=1)
    hn = he.EncodedHintNet(net)
    buf = he.encode(he.encoder_of(net), hint).clone()
    hn.use(hint, buf)
    before = hn(x, hint, t, ctx)
    hint.copy_(hint2)  # the glue refreshes the hint buffer and its encoding in place
    buf.copy_(he.encode(he.encoder_of(net), hint))
    assert _equal(net(x, hint, t, ctx), hn(x, hint, t, ctx))
    assert not _equal(before, hn(x, hint, t, ctx))


def test_any_other_hint_runs_the_whole_network():
    """A caller that hands another tensor (a sliced batch, a new hint) gets the network's own
    result, never the encoding of a different hint."""
    net = _Net()
    x, hint, t, ctx = _inputs()
    hn = he.EncodedHintNet(net)
    hn.use(hint, he.encode(he.encoder_of(net), hint))
    half = hint[:1]
    assert _equal(net(x[:1], half, t[:1], ctx[:1]), hn(x[:1], half, t[:1], ctx[:1]))
    other = hint.clone()
    assert _equal(net(x, other, t, ctx), hn(x, other, t, ctx))
    assert (hn.encoded_calls, hn.full_calls) == (0, 2)
    hn.use(None, None)  # cleared: even the same tensor runs the whole network
    assert _equal(net(x, hint, t, ctx), hn(x, hint, t, ctx)) and hn.full_calls == 3
    # compiled mode hands a maker of the whole network's runner, asked only when needed
    asked = []
    hn.whole = lambda n: asked.append(n) or n
    hn.use(hint, he.encode(he.encoder_of(net), hint))
    hn(x, hint, t, ctx)
    assert asked == []
    assert _equal(net(x[:1], half, t[:1], ctx[:1]), hn(x[:1], half, t[:1], ctx[:1]))
    assert asked == [net]


def test_a_replaced_layer_is_seen_and_the_compiled_copy_is_dropped():
    net = _Net()
    x, hint, t, ctx = _inputs()
    hn = he.EncodedHintNet(net)
    first = hn.headless
    hn.inner = object()  # stands for a compiled copy of ``first``
    assert hn.headless is first and hn.inner is not None  # nothing changed: same copy
    net.out = torch.nn.Conv2d(6, 6, 1)  # a patch replaced a direct child
    assert hn.headless is not first and hn.inner is None
    hn.use(hint, he.encode(he.encoder_of(net), hint))
    assert _equal(net(x, hint, t, ctx), hn(x, hint, t, ctx))
    with pytest.raises(AttributeError):
        hn.anything = 1  # the stand-in is never written to, except its inner runner


def test_the_network_is_held_weakly():
    net = _Net()
    hn = he.EncodedHintNet(net)
    ref = weakref.ref(net)
    del net
    gc.collect()
    assert ref() is None and hn.real is None
    x, hint, t, ctx = _inputs()
    with pytest.raises(RuntimeError, match="gone"):
        hn(x, hint, t, ctx)
