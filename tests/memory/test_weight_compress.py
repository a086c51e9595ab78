# SPDX-License-Identifier: GPL-3.0-or-later
"""INT8 weight compression (memory/weight_compress.py), plain torch, against fp64 references."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.memory import weight_compress as wc

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_rounding_error_is_at_most_half_a_step_per_channel():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, 3, 3, generator=g) * torch.logspace(-3, 1, 64).view(-1, 1, 1, 1)
    q, scale = wc.quantize_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (64, 1, 1, 1)
    assert int(q.abs().max()) == 127  # the full range is used
    err = (q.double() * scale.double() - w.double()).abs()
    assert (err <= scale.double() / 2 * (1 + 1e-6)).all()
    # a channel of zeros stays zeros (no division by zero)
    w[3] = 0
    q, scale = wc.quantize_per_channel(w)
    assert torch.isfinite(scale).all() and (q[3] == 0).all()


def test_quantizing_a_few_rows_at_a_time_gives_the_whole_layer_result(monkeypatch):
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(37, 20, 3, 3, generator=g) * torch.rand(37, 1, 1, 1, generator=g)).half()
    whole_q, whole_s = wc.quantize_per_channel(w)  # one chunk: 37 * 180 elements
    monkeypatch.setattr(wc, "CHUNK_ELEMENTS", 400)  # 2 rows per chunk, the last one alone
    q, s = wc.quantize_per_channel(w)
    assert torch.equal(q, whole_q) and torch.equal(s, whole_s)
    assert q.shape == w.shape and s.shape == (37, 1, 1, 1)
    ref_s = w.float().reshape(37, -1).abs().amax(1) / 127
    assert torch.equal(s.reshape(-1), ref_s)


def test_small_layers_kept_are_the_smallest_within_the_share(monkeypatch):
    monkeypatch.delenv("CNA_POOL_SMALL_SHARE", raising=False)
    big = wc.SMALL_NUMEL
    sizes = {"a": 10_000, "b": 20_000, "c": 30_000, "big1": 4 * big, "big2": 4 * big}
    total = sum(sizes.values())
    # all three small ones fit in 4% of the total only if it is large enough
    assert wc.small_layers_kept(sizes, share=1.0) == {"a", "b", "c"}  # never a layer >= SMALL
    assert wc.small_layers_kept(sizes, share=0.0) == set()
    assert wc.small_layers_kept(sizes, share=30_000 / total) == {"a", "b"}  # smallest first
    assert wc.small_layers_kept(sizes, share=29_999 / total) == {"a"}
    # the default share, and the override for measurements
    kept = wc.small_layers_kept(sizes)
    assert sum(sizes[k] for k in kept) <= wc.SMALL_SHARE * total and kept
    monkeypatch.setenv("CNA_POOL_SMALL_SHARE", "0")
    assert wc.small_layers_kept(sizes) == set()


# fp16 runs on the GPU only (ComfyUI computes in fp32 or bf16 on the CPU)
CASES = [
    (d, t)
    for d in DEVICES
    for t in (torch.float32, torch.float16, torch.bfloat16)
    if not (d == "cpu" and t == torch.float16)
]


def _conv_and_linear(device, dtype, seed):
    """A strided Conv2d and a Linear with an input each: ((conv, x), (lin, y))."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.nn.Conv2d(32, 48, 3, padding=1, stride=2).to(device, dtype)
    lin = torch.nn.Linear(96, 80).to(device, dtype)
    x = torch.randn(2, 32, 16, 16, generator=g).to(device, dtype)
    y = torch.randn(2, 7, 96, generator=g).to(device, dtype)
    return (conv, x), (lin, y)


@pytest.mark.parametrize("device,dtype", CASES)
def test_int8_layers_compute_with_the_dequantized_weight(device, dtype):
    (conv, x), (lin, y) = _conv_and_linear(device, dtype, seed=1)
    for layer, inp, fn in ((conv, x, torch.nn.functional.conv2d), (lin, y, None)):
        c = wc.compress(layer)
        out = c(inp)
        assert out.dtype == dtype and out.device.type == device
        q, s = wc.quantize_per_channel(layer.weight)
        wd = (q.double() * s.double()).to(device)
        if fn is None:
            ref = torch.nn.functional.linear(inp.double(), wd, layer.bias.double())
        else:
            ref = fn(inp.double(), wd, layer.bias.double(), 2, 1)
        # the only difference to the reference is the dtype's own rounding
        tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol
        # and against the uncompressed layer: int8 rounding, well under 1% here
        exact = layer(inp).double()
        assert ((out.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_sizes_and_what_is_left_alone():
    conv = torch.nn.Conv2d(64, 64, 3).half()
    c = wc.compress(conv)
    assert c.original_bytes() == 64 * 64 * 9 * 2 + 64 * 2
    assert c.compressed_bytes() == 64 * 64 * 9 + 64 * 4 + 64 * 2
    assert wc.why_not(torch.nn.Conv2d(4, 4, 1)) == "small"
    assert wc.why_not(torch.nn.GroupNorm(4, 64)) == "not a Linear or Conv2d"
    assert wc.why_not(c) == "already compressed or streamed"
    st = wc.compress(conv, mode="stream")
    assert st.compressed_bytes() == 64 * 2 and st.original_bytes() == 64 * 64 * 9 * 2 + 64 * 2
    assert wc.why_not(st) == "already compressed or streamed"
    assert [n for n, _ in st.named_parameters()] == ["bias"]  # the weight is no parameter
    assert not list(st.buffers())
    circ = torch.nn.Conv2d(64, 64, 3, padding=1, padding_mode="circular")
    assert "padding_mode" in wc.why_not(circ)
    patched = torch.nn.Linear(128, 128)
    patched.weight_function = [lambda w: w]
    assert "patched" in wc.why_not(patched)
    with pytest.raises(ValueError, match="small"):
        wc.compress(torch.nn.Linear(8, 8))


@pytest.mark.parametrize("device,dtype", CASES)
def test_streamed_layers_compute_exactly_what_the_originals_compute(device, dtype):
    for layer, inp in _conv_and_linear(device, dtype, seed=4):
        s = wc.compress(layer, mode="stream")
        assert s.host_weight.device.type == "cpu"
        assert s.host_weight.is_pinned() == torch.cuda.is_available()
        s.to(device)  # what ComfyUI's loader does: the bias moves, the weight stays in RAM
        assert s.host_weight.device.type == "cpu"
        assert torch.equal(s(inp), layer(inp))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_weights_left_on_the_cpu_are_brought_to_the_input():
    lin = torch.nn.Linear(256, 128)
    c = wc.compress(lin)  # stays on the CPU, as ComfyUI's low-VRAM mode leaves some layers
    x = torch.randn(4, 256, device="cuda")
    out = c(x)
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), c(x.cpu()), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_quantizing_on_the_gpu_gives_the_cpu_result():
    """The Memory Pool quantizes CPU-resident weights on the GPU (seconds → milliseconds). The
    scales must be the CPU's; an int8 value may differ by one step only where w/scale sits on a
    rounding boundary (the two devices' division may round the last bit differently)."""
    g = torch.Generator().manual_seed(0)
    for shape in [(320, 320, 3, 3), (1280, 768), (4, 4096)]:
        w = (torch.randn(shape, generator=g) * torch.rand(shape[0], *[1] * (len(shape) - 1))).half()
        q_cpu, s_cpu = wc.quantize_per_channel(w)
        q_gpu, s_gpu = wc.quantize_per_channel(w.cuda())
        q_gpu, s_gpu = q_gpu.cpu(), s_gpu.cpu()
        d = (q_gpu.int() - q_cpu.int()).abs()
        scale_err = ((s_gpu - s_cpu).abs() / s_cpu).max().item()
        msg = f"{shape}: scale rel err {scale_err:.3g}, int8 max diff {d.max().item()}, " + (
            f"{(d > 0).float().mean().item():.3g} of values differ"
        )
        assert scale_err <= 1.2e-7 and d.max().item() <= 1, msg
        # every differing value sits on a rounding boundary: w/scale is within the two devices'
        # float32 rounding (scale and quotient, a few parts in 1e7) of a half-integer
        x = w.double().reshape(w.shape[0], -1) / s_cpu.double().reshape(-1, 1)
        off_half = (x - x.floor() - 0.5).abs().reshape(d.shape)
        assert (off_half[d > 0] <= 5e-7 * x.abs().reshape(d.shape)[d > 0] + 1e-9).all(), msg
        assert (d > 0).float().mean().item() <= 1e-3, msg
        err = (q_gpu.float() * s_gpu - w.float()).abs()
        assert (err <= s_gpu * (0.5 + 1e-4)).all(), msg


def test_no_page_locked_ram_streams_pageable_and_says_so(monkeypatch, caplog):
    """Pinning fails (RAM limits): the layer still computes exactly, from pageable memory, and
    one warning names the node, the cause and the way out."""

    def refuse(self, *a, **k):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    monkeypatch.setattr(wc, "_pageable_warned", False)
    lin = torch.nn.Linear(96, 80)
    with caplog.at_level("WARNING", logger="ControlNetAccelerator"):
        s1 = wc.compress(lin, mode="stream")
        s2 = wc.compress(lin, mode="stream")
    assert not s1.host_weight.is_pinned() and not s2.host_weight.is_pinned()
    warned = [r.message for r in caplog.records if "page-lock" in r.message]
    assert len(warned) == 1 and "Memory Pool" in warned[0] and "'int8'" in warned[0]
    x = torch.randn(3, 96)
    assert torch.equal(s1(x), lin(x))
