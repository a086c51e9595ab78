# SPDX-License-Identifier: GPL-3.0-or-later
"""GroupNorm (+SiLU) on channels-last activations: the op against an fp64 reference written
here, its launch limits against the CUDA source, and the graph rewrite that puts it into
compiled code.

Tier 1 (CPU): the op's PyTorch path, the rewrite (forced on, since the CUDA kernel does not
serve the CPU) and its compiled result against eager. Tier 2 (``cuda``): the CUDA kernel at SD
shapes and odd ones, in a CUDA graph, and inside inductor's code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from comfyui_controlnet_accelerator import kernels
from comfyui_controlnet_accelerator.graphs.compiled import CompiledModule, CompileOptions
from comfyui_controlnet_accelerator.kernels import _jit, constraints, registry
from comfyui_controlnet_accelerator.kernels.fx_rewrites import GroupNormRewrite, pays

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# SD1.5 and SDXL ResBlock shapes at batch 2 (CFG), including the up blocks' concatenated widths
# whose groups are not a whole number of 16-byte vectors (1920 / 32 = 60, 960 / 32 = 30), and
# odd sizes: channels no vector divides, a single pixel row, a 1×1 image.
SHAPES = [
    (2, 320, 64, 64),
    (2, 1280, 8, 8),
    (2, 2560, 16, 16),
    (2, 1920, 32, 32),
    (2, 960, 64, 64),
    (1, 36, 5, 7),
    (3, 64, 1, 9),
    (2, 32, 1, 1),
]


def _cl(t):
    return t.contiguous(memory_format=torch.channels_last)


def _ref(x, w, b, groups, eps, silu):
    shape = x.shape
    g = x.double().reshape(shape[0], groups, -1)
    xn = (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + eps)
    y = xn.reshape(shape) * w.double()[:, None, None] + b.double()[:, None, None]
    return y * torch.sigmoid(y) if silu else y


def _rel(got, ref):
    ref = ref.double()
    return (got.double() - ref).norm().item() / (ref.norm().item() or 1.0)


def _inputs(shape, dtype, device, seed, offset=0.5):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = _cl((torch.randn(shape, generator=gen, device=device) * 2 + offset).to(dtype))
    w = (torch.rand(shape[1], generator=gen, device=device) + 0.5).to(dtype)
    b = torch.randn(shape[1], generator=gen, device=device).to(dtype)
    return x, w, b


def _cuda_ready():
    return torch.cuda.is_available() and _jit.ensure_loaded() is not None


def _setup(device):
    if device == "cuda" and not _cuda_ready():
        pytest.skip("CUDA extension not loaded: " + str(kernels.list_backends()))
    return kernels.use_backend("cuda" if device == "cuda" else "eager")


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "plain"])
def test_matches_reference_and_keeps_channels_last(device, dtype, shape, silu):
    """Our error may be at most twice that of PyTorch's GroupNorm in the same dtype (and within
    the dtype's rounding); on the CPU the op is PyTorch's, so there a fixed bound applies."""
    if device == "cpu" and dtype != torch.float32 and shape[1] * shape[2] * shape[3] > 2**18:
        pytest.skip("large half-precision shapes: the CUDA tier covers them")
    with _setup(device):
        groups = 4 if shape[1] == 36 else 32
        x, w, b = _inputs(shape, dtype, device, seed=sum(shape))
        got = kernels.group_norm_nhwc(x, w, b, groups, 1e-5, silu)
        assert got.dtype == dtype and got.shape == x.shape
        assert got.is_contiguous(memory_format=torch.channels_last)
        ref = _ref(x, w, b, groups, 1e-5, silu)
        torch_y = F.group_norm(x, groups, w, b, 1e-5)
        torch_err = _rel(F.silu(torch_y) if silu else torch_y, ref)
        bound = max(2 * torch_err, TOL[dtype]) if device == "cuda" else max(TOL[dtype], 3e-5)
        assert _rel(got, ref) <= bound, (_rel(got, ref), torch_err)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_a_large_mean_does_not_cancel_the_variance(dtype):
    """Groups whose mean is 200 times their spread: sums of squares in fp32 would lose the
    variance; per-thread runs turned into (count, mean, M2) keep it."""
    with _setup("cuda"):
        x, w, b = _inputs((2, 320, 32, 32), dtype, "cuda", seed=3, offset=0.0)
        x = _cl((x.float() * 0.5 + 100.0).to(dtype))
        got = kernels.group_norm_nhwc(x, w, b, 32, 1e-5, True)
        ref = _ref(x, w, b, 32, 1e-5, True)
        torch_err = _rel(F.silu(F.group_norm(x, 32, w, b, 1e-5)), ref)
        assert _rel(got, ref) <= max(2 * torch_err, TOL[dtype]), (_rel(got, ref), torch_err)


@pytest.mark.cuda
def test_unaligned_input_takes_the_scalar_path_and_is_right():
    """A view 2 bytes into its storage cannot use 16-byte vectors: the kernel reads one value
    at a time (C within the scalar limit) and the result is the same math."""
    with _setup("cuda"):
        x, w, b = _inputs((2, 64, 8, 8), torch.float16, "cuda", seed=4)
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")
        xs = flat[1:].view(2, 8, 8, 64).permute(0, 3, 1, 2)
        xs.copy_(x)
        assert xs.is_contiguous(memory_format=torch.channels_last) and xs.data_ptr() % 16
        got = kernels.group_norm_nhwc(xs, w, b, 32, 1e-5, True)
        assert _rel(got, _ref(x, w, b, 32, 1e-5, True)) <= TOL[torch.float16]


@pytest.mark.cuda
def test_replays_in_a_cuda_graph_with_new_inputs():
    with _setup("cuda"):
        x, w, b = _inputs((2, 640, 32, 32), torch.float16, "cuda", seed=6)
        kernels.group_norm_nhwc(x, w, b, 32, 1e-5, True)  # build, warm
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g):
            y = kernels.group_norm_nhwc(x, w, b, 32, 1e-5, True)
        torch.cuda.current_stream().wait_stream(s)
        for seed in (7, 8):
            x.copy_(_inputs((2, 640, 32, 32), torch.float16, "cuda", seed=seed)[0])
            g.replay()
            torch.cuda.synchronize()
            assert _rel(y, _ref(x, w, b, 32, 1e-5, True)) <= TOL[torch.float16]


def test_limits_match_the_cuda_source():
    src = (Path(_jit.CSRC) / "ops" / "group_norm_nhwc.cu").read_text()

    def const(name):
        return int(re.search(rf"constexpr int {name} = (\d+);", src).group(1))

    lim = constraints.CUDA_LIMITS["group_norm_nhwc"]
    assert lim["max_channel_vectors"] == const("kNhwcMaxChannelVectors")
    # two channel vectors per thread at most (the kernel's NV), and 48 KiB of shared memory
    assert lim["max_channel_vectors"] <= 2 * const("kNhwcThreads")
    assert lim["max_channel_vectors"] * 16 // 2 * 3 * 4 <= 48 * 1024


def test_outside_the_limits_the_op_runs_pytorch():
    """Too many channels for the kernel, or a layout it does not read: the dispatch says so
    before any launch (the CUDA backend is never asked)."""
    x = _cl(torch.randn(1, 8192, 2, 2, dtype=torch.float16))
    w, b = torch.ones(8192, dtype=torch.float16), torch.zeros(8192, dtype=torch.float16)
    why = constraints.cuda_launch_problem("group_norm_nhwc", x=x, weight=w, bias=b, groups=32)
    assert why and "channels" in why
    x2 = torch.randn(1, 64, 4, 4)
    why = constraints.cuda_launch_problem(
        "group_norm_nhwc", x=x2, weight=torch.ones(64), bias=torch.zeros(64), groups=32
    )
    assert why == "x is not channels-last"
    got = kernels.group_norm_nhwc(x2, torch.ones(64), torch.zeros(64), 32)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(got, F.group_norm(x2, 32, torch.ones(64), torch.zeros(64)), atol=1e-6)


# -- the graph rewrite -----------------------------------------------------------------------


class ResBlockish(nn.Module):
    """GroupNorm+SiLU before a conv, a plain GroupNorm, a GroupNorm with two users, and one on
    a plain NCHW tensor (which must be left alone)."""

    def __init__(self, c=64):
        super().__init__()
        self.conv_in = nn.Conv2d(4, c, 3, padding=1)
        self.norm1 = nn.GroupNorm(32, c)
        self.act = nn.SiLU()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(32, c, eps=1e-6)
        self.norm3 = nn.GroupNorm(8, c)
        self.norm_nchw = nn.GroupNorm(4, 4)

    def forward(self, x):
        h = self.conv(self.act(self.norm1(self.conv_in(x))))
        n2 = self.norm2(h)
        n3 = self.norm3(h)
        return n2 + F.silu(n3) * n3, self.norm_nchw(x)


def _model(dtype, device):
    torch.manual_seed(0)
    m = ResBlockish().to(device=device, dtype=dtype).eval().requires_grad_(False)
    for p in m.parameters():
        if p.dim() == 4:
            p.data = _cl(p.data)
    return m


def _graph_of(m, x, rewrite=None):
    """Dynamo's graph of ``m`` (rewritten by ``rewrite`` first, if given) and the output of
    running that graph on ``x``."""
    got = []

    def backend(gm, example_inputs):
        if rewrite is not None:
            got.append(rewrite.rewrite(gm))
        got.insert(0, gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(m, backend=backend)(x)
    return got, out


def test_rewrite_replaces_channels_last_group_norms_and_takes_silu_along():
    m = _model(torch.float32, "cpu")
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        (gm, counts), got = _graph_of(m, x, GroupNormRewrite(force=True))
        ref = m(x)
    assert counts == (3, 1)  # norm1 with its SiLU, norm2, norm3 (two users: its SiLU stays)
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.cna.group_norm_nhwc.default]
    assert sorted(n.args[5] for n in calls) == [False, False, True]
    assert len([n for n in gm.graph.nodes if n.target is F.group_norm]) == 1  # the NCHW one
    assert not [n for n in gm.graph.nodes if n.target is F.silu and n.args[0] in calls[:1]]
    for r, g in zip(ref, got, strict=True):
        assert torch.allclose(r, g, atol=1e-5)


def test_rewrite_is_off_where_the_kernel_does_not_serve():
    """Not forced: on the CPU (and on a GPU whose kernel sources have not passed their tests)
    the graph is left to inductor; under grad mode with trainable weights, too."""
    m = _model(torch.float32, "cpu")
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        (gm,), _ = _graph_of(m, x)
        assert GroupNormRewrite().rewrite(gm) == (0, 0)
        assert GroupNormRewrite()(gm) is None
    m.requires_grad_(True)
    (gm,), _ = _graph_of(m, x)
    assert GroupNormRewrite(force=True).rewrite(gm) == (0, 0)


@pytest.mark.parametrize("device", _devices())
def test_compiled_with_the_rewrite_matches_eager(device):
    """Through the pack's compiled module: on the GPU inductor's code calls the kernel (fp16);
    on the CPU AOTAutograd traces the op through its fake and runs its PyTorch path (fp32;
    ``aot_eager``, as the host tests compile on the CPU: no C++ to build on a small machine).
    Either gives eager's result. The rewrite is forced: at this size the kernel does not pay
    (``pays``), and the point here is the kernel inside compiled code."""
    if device == "cuda" and not _cuda_ready():
        pytest.skip("CUDA extension not loaded")
    dtype = torch.float16 if device == "cuda" else torch.float32
    m = _model(dtype, device)
    x = torch.randn(2, 4, 16, 16, device=device, dtype=dtype)
    rewrite = GroupNormRewrite(force=True)
    with kernels.use_backend("cuda" if device == "cuda" else "eager"), torch.no_grad():
        if device == "cuda":
            assert registry.select("group_norm_nhwc", [x]) == "cuda"
        seen = []
        opts = CompileOptions(
            graph_passes=(lambda gm: seen.append(rewrite.rewrite(gm)),),
            backend="inductor" if device == "cuda" else "aot_eager",
        )
        cm = CompiledModule(m, "ResBlockish", opts)
        got = cm(x)
        assert cm.stats()["compiled_signatures"] == 1, cm.stats()
        assert seen and seen[0][0] == 3, seen
        ref = m(x)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for r, g in zip(ref, got, strict=True):
        assert _rel(g, r) <= tol


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((2, 320, 64, 64), False),  # inductor's best case (SD1.5 512², first level)
        ((2, 1280, 16, 16), False),  # small: three launches cost more than the data
        ((2, 1280, 8, 8), False),
        ((2, 640, 32, 32), True),
        ((2, 960, 64, 64), True),
        ((2, 2560, 32, 32), True),
        ((2, 320, 128, 128), True),  # SDXL 1024², first level
    ],
)
def test_the_rewrite_takes_only_the_sizes_where_the_kernel_was_faster(shape, expected):
    assert pays(shape) is expected


def test_on_a_gpu_the_rule_and_the_environment_switch_decide(monkeypatch):
    """With the CUDA kernel serving (stood in for: no GPU here) and ``CNA_COMPILE_GROUP_NORM=1``,
    a SDXL-sized GroupNorm is taken and SD1.5's first level is not; without the switch (the
    default) none is."""
    from comfyui_controlnet_accelerator.kernels import fx_rewrites
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(fx_rewrites.registry, "select", lambda op, tensors: "cuda")
    monkeypatch.setenv(fx_rewrites.ENV, "1")
    with FakeTensorMode():

        def case(c, hw):
            x = torch.empty(2, c, hw, hw, device="cuda", dtype=torch.float16)
            w = torch.empty(c, device="cuda", dtype=torch.float16)
            return GroupNormRewrite()._takes(_cl(x), w, w, 32)

        assert case(640, 64) and case(320, 128)
        assert not case(320, 64) and not case(1280, 16)
        monkeypatch.setenv(fx_rewrites.ENV, "0")
        assert not case(640, 64)
        monkeypatch.delenv(fx_rewrites.ENV)
        assert not case(640, 64)
