# SPDX-License-Identifier: GPL-3.0-or-later
"""The Memory Pool's expansion groups (memory/weight_compress.py ``ExpansionGroup``): a block's
INT8 layers expanded by one launch, each layer getting exactly the weight it would expand alone.
The same tests run on the GPU, where the launch is the extension's ``dequant_rows_multi_``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from comfyui_controlnet_accelerator import kernels
from comfyui_controlnet_accelerator.memory import weight_compress as wc

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _linear_layers_expand(monkeypatch):
    """Linear layers join their block's group where ``int8_linear`` expands their weight (the
    default). ``CNA_KERNELS=cuda``, which GPU test runs set, makes it read the INT8 weight
    directly and leaves them out (its own test below): these tests run in the default mode."""
    from comfyui_controlnet_accelerator.kernels import registry

    monkeypatch.setattr(registry, "_mode", "auto")


class Block(torch.nn.Module):
    """The shape of an SD transformer block (attention projections, a GEGLU feed-forward),
    with a convolution before it, as in a UNet's ResBlock + SpatialTransformer."""

    def __init__(self, c: int = 64, ctx: int = 80):
        super().__init__()
        self.conv = torch.nn.Conv2d(c, c, 3, padding=1)
        self.to_q = torch.nn.Linear(c, c, bias=False)
        self.to_k = torch.nn.Linear(ctx, c, bias=False)
        self.to_v = torch.nn.Linear(ctx, c, bias=False)
        self.to_out = torch.nn.Linear(c, c)
        self.ff_in = torch.nn.Linear(c, 8 * c)
        self.ff_out = torch.nn.Linear(4 * c, c)

    def forward(self, img, ctx):
        h = self.conv(img)
        x = h.flatten(2).transpose(1, 2)
        a = F.scaled_dot_product_attention(self.to_q(x), self.to_k(ctx), self.to_v(ctx))
        x = x + self.to_out(a)
        v, g = self.ff_in(x).chunk(2, dim=-1)
        return x + self.ff_out(v * F.gelu(g))


def _compressed(block: Block) -> list[tuple[str, torch.nn.Module]]:
    out = []
    for name, m in list(block.named_children()):
        c = wc.compress(m, mode="int8")
        setattr(block, name, c)
        out.append((f"input_blocks.1.1.transformer_blocks.0.{name}", c))
    return out


def _inputs(device, dtype, c=64, ctx=80):
    g = torch.Generator().manual_seed(1)
    img = torch.randn(2, c, 8, 8, generator=g).to(device, dtype)
    context = torch.randn(2, 7, ctx, generator=g).to(device, dtype)
    return img, context


def _count_launches(monkeypatch) -> list[int]:
    """The weights of each ``dequant_rows_multi`` call from now on (one entry per launch)."""
    calls: list[int] = []
    real = kernels.dequant_rows_multi

    def counting(qs, scales, dtype):
        calls.append(len(qs))
        return real(qs, scales, dtype)

    monkeypatch.setattr(kernels, "dequant_rows_multi", counting)
    return calls


def _dtypes(device):
    return [torch.float32, torch.bfloat16] + ([torch.float16] if device == "cuda" else [])


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_block_gives_the_ungrouped_result_bit_for_bit(device, monkeypatch):
    monkeypatch.delenv("CNA_POOL_GROUPS", raising=False)
    torch.manual_seed(0)
    block = Block().to(device)
    layers = _compressed(block)
    for dtype in _dtypes(device):
        block.to(dtype)
        for _, m in layers:  # the INT8 weights stay int8 / fp32 scales (as ComfyUI loads them)
            m.q.data = m.q.data.to(torch.int8)
            m.scale.data = m.scale.data.float()
        img, ctx = _inputs(device, dtype)
        for _, m in layers:
            m.expansion_group = None
        alone = block(img, ctx)
        # the block's largest layer is the convolution (36,864 weights): the four attention
        # projections (18,432) form a group, ff_in + ff_out (49,152) would exceed it
        assert wc.form_expansion_groups(layers, device) == 1
        group = layers[1][1].expansion_group
        assert group is not None and len(group) == 4
        assert all(m.expansion_group is group for _, m in layers[1:5])
        assert all(m.expansion_group is None for _, m in layers[:1] + layers[5:])
        grouped = block(img, ctx)
        again = block(img, ctx)  # the next step expands again
        assert torch.equal(grouped, alone), dtype
        assert torch.equal(again, alone), dtype


@pytest.mark.parametrize("device", DEVICES)
def test_a_group_expands_once_per_pass_and_hands_each_layer_its_own_weight(device, monkeypatch):
    torch.manual_seed(0)
    block = Block().to(device)
    layers = _compressed(block)
    wc.form_expansion_groups(layers, device)
    calls = _count_launches(monkeypatch)
    img, ctx = _inputs(device, torch.float32)
    block(img, ctx)
    assert calls == [4]  # one launch for the four attention projections
    block(img, ctx)
    assert calls == [4, 4]
    members = [m for _, m in layers[1:5]]
    group = members[0].expansion_group
    for m in members:  # each view is its layer's own expansion, one launch for them all
        w = group.take(m, img)
        assert w.shape == m.q.shape
        assert torch.equal(w, wc.dequantize(m.q, m.scale, torch.float32, img.device))
    assert calls == [4, 4, 4]
    # a layer asking again (its view used) makes the group expand again: nothing is reused
    group.take(members[0], img)
    group.take(members[0], img)
    assert calls == [4, 4, 4, 4, 4]


@pytest.mark.parametrize("device", DEVICES)
def test_views_are_not_handed_across_dtypes_and_release_drops_unused_ones(device):
    torch.manual_seed(0)
    block = Block().to(device)
    layers = _compressed(block)
    wc.form_expansion_groups(layers, device)
    a, b = layers[1][1], layers[2][1]
    group = a.expansion_group
    x32 = torch.zeros(1, device=device)
    w = group.take(a, x32)
    assert w.dtype == torch.float32
    # b's view was made in float32: asked for in bfloat16 it is made again, in bfloat16
    xb = x32.bfloat16()
    wb = group.take(b, xb)
    assert wb.dtype == torch.bfloat16
    assert torch.equal(wb, wc.dequantize(b.q, b.scale, torch.bfloat16, x32.device))
    assert len(group._ready) == 3  # made for the others in bfloat16
    group.release()
    assert group._ready == {}
    wc.release_expansions([m for _, m in layers])  # idempotent, and skips other modules
    wc.release_expansions([torch.nn.Linear(2, 2)])


def test_a_weight_on_another_device_than_the_input_expands_alone():
    block = Block()
    layers = _compressed(block)
    wc.form_expansion_groups(layers)
    m = layers[2][1]
    fake = torch.empty(1, device="meta")
    assert m.expansion_group.take(m, fake) is None


def test_blocks_groups_limits_and_switch(monkeypatch):
    assert wc.block_of("diffusion_model.input_blocks.4.1.transformer_blocks.1.attn1.to_q") == (
        "diffusion_model.input_blocks.4.1.transformer_blocks.1"
    )
    assert wc.block_of("input_blocks.4.1.transformer_blocks.0.ff.net.0.proj") == (
        "input_blocks.4.1.transformer_blocks.0"
    )
    assert (
        wc.block_of("diffusion_model.input_blocks.4.1.proj_in")
        == "diffusion_model.input_blocks.4.1"
    )
    assert wc.block_of("diffusion_model.input_blocks.2.0.in_layers.2") == (
        "diffusion_model.input_blocks.2.0"
    )
    assert wc.block_of("diffusion_model.middle_block.0.out_layers.3") == (
        "diffusion_model.middle_block.0"
    )
    assert wc.block_of("zero_convs.3.0") == "zero_convs.3"
    assert wc.block_of("label_emb.0.0") == "label_emb.0"
    assert wc.block_of("conv_in") == ""

    def layer(o, i):
        return wc.compress(torch.nn.Linear(i, o, bias=False), mode="int8")

    a, b, c, d = layer(64, 64), layer(64, 64), layer(128, 64), layer(64, 64)
    named = [
        ("m.input_blocks.1.0.x", a),
        ("m.input_blocks.1.0.y", b),
        ("m.input_blocks.1.0.z", c),
        ("m.input_blocks.2.0.x", d),  # alone in its block: no group
        ("m.other", torch.nn.Linear(2, 2)),  # not INT8: ignored
    ]
    monkeypatch.delenv("CNA_POOL_GROUPS", raising=False)
    # a group holds at most the largest layer's weights (c: 8,192): a + b, then c alone
    assert wc.form_expansion_groups(named) == 1
    assert a.expansion_group is b.expansion_group is not None
    assert c.expansion_group is None and d.expansion_group is None
    assert a.working_bytes() == 64 * 64 * 2 * 4  # fp32 weights, the whole group
    assert a.working_bytes() <= c.working_bytes() == 128 * 64 * 4  # no more than the largest
    # a larger largest layer lets the whole block in; the absolute cap still splits it
    e = layer(256, 128)
    named.append(("m.out.0", e))
    assert wc.form_expansion_groups(named) == 1
    assert a.expansion_group is b.expansion_group is c.expansion_group
    assert d.expansion_group is None and e.expansion_group is None
    monkeypatch.setattr(wc, "GROUP_MAX_NUMEL", 64 * 64 * 2)
    assert wc.form_expansion_groups(named) == 1
    assert a.expansion_group is b.expansion_group and c.expansion_group is None
    # off for measurements
    monkeypatch.setenv("CNA_POOL_GROUPS", "0")
    assert wc.form_expansion_groups(named) == 0
    assert a.expansion_group is None and b.expansion_group is None


def test_linear_layers_stay_out_when_int8_linear_reads_int8(monkeypatch):
    from comfyui_controlnet_accelerator.kernels import registry

    monkeypatch.delenv("CNA_POOL_GROUPS", raising=False)
    lin = [wc.compress(torch.nn.Linear(64, 64), mode="int8") for _ in range(2)]
    conv = [wc.compress(torch.nn.Conv2d(64, 16, 3), mode="int8") for _ in range(2)]
    big = wc.compress(torch.nn.Conv2d(64, 64, 3), mode="int8")  # the largest, in another block
    named = [(f"b.1.{i}", m) for i, m in enumerate(lin + conv)] + [("b.2.0", big)]
    monkeypatch.setattr(registry, "_mode", "cuda")
    assert not kernels.int8_linear_expands("cuda")
    assert kernels.int8_linear_expands("cpu")
    assert wc.form_expansion_groups(named, torch.device("cuda")) == 1
    assert all(m.expansion_group is None for m in lin)
    assert conv[0].expansion_group is conv[1].expansion_group is not None
    monkeypatch.setattr(registry, "_mode", "auto")
    assert wc.form_expansion_groups(named, torch.device("cuda")) == 1
    assert all(m.expansion_group is conv[0].expansion_group for m in lin)


@pytest.mark.parametrize("device", DEVICES)
def test_dequant_rows_multi_lays_out_each_weight_as_dequant_rows_makes_it(device):
    g = torch.Generator().manual_seed(3)
    shapes = [(32, 16), (8, 48, 3, 3), (5, 7), (64, 32)]  # (5, 7): rows not a multiple of 16
    qs = [torch.randint(-127, 128, s, generator=g, dtype=torch.int8).to(device) for s in shapes]
    ss = [torch.rand(s[0], generator=g).to(device) + 0.01 for s in shapes]
    for dtype in _dtypes(device):
        views = kernels.dequant_rows_multi(qs, ss, dtype)
        base = views[0].untyped_storage().data_ptr()
        off = 0
        for v, q, s in zip(views, qs, ss, strict=True):
            assert v.shape == q.shape and v.dtype == dtype and v.is_contiguous()
            assert v.untyped_storage().data_ptr() == base  # one allocation
            assert v.data_ptr() == base + off * v.element_size()
            off += q.numel()
            assert torch.equal(v, kernels.dequant_rows(q, s, dtype))
    assert kernels.dequant_rows_multi([], [], torch.float32) == []
    with pytest.raises(ValueError):
        kernels.dequant_rows_multi(qs[:2], ss[:1], torch.float32)
    with pytest.raises(ValueError):
        kernels.dequant_rows_multi([qs[0].float()], [ss[0]], torch.float32)


def test_compiled_code_expands_each_layer_itself(monkeypatch):
    """torch.compile traces the layers without the group (whose views are host-side state) and
    gives the eager result; eager calls after it still use the group."""
    monkeypatch.delenv("CNA_POOL_GROUPS", raising=False)
    torch.manual_seed(0)
    block = Block()
    layers = _compressed(block)
    wc.form_expansion_groups(layers)
    img, ctx = _inputs("cpu", torch.float32)
    want = block(img, ctx)
    calls = _count_launches(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager")
    got = compiled(img, ctx)
    assert torch.equal(got, want)
    assert calls == []  # the traced code expanded each layer itself
    assert torch.equal(block(img, ctx), want) and calls == [4]
    torch._dynamo.reset()
