# SPDX-License-Identifier: GPL-3.0-or-later
"""The attention-backend choice of compiled mode (kernels/attention_choice.py) on graphs dynamo
traces from ComfyUI's attention pattern: ``sdpa_kernel(priority, set_priority=True)`` around one
``scaled_dot_product_attention``. CPU: the timer is the test's own, so what is checked is which
call is edited, how, and what is remembered. On a GPU the real timer runs on the real backends."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from comfyui_controlnet_accelerator.kernels import attention_choice as ac
from torch.nn.attention import SDPBackend, sdpa_kernel

COMFY_033 = [  # ComfyUI 0.33's order; 0.3.64 puts cuDNN first
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


COMFY_0364 = [COMFY_033[1], COMFY_033[0], *COMFY_033[2:]]  # cuDNN first


def _cudnn_then_flash(heads: int):
    """A self-attention in a cuDNN-first block (0.3.64's order), then a cross-attention in a
    flash-first one (0.33's), with ``heads`` heads."""

    def both(x, ctx):
        b, n, c = x.shape
        q = x.view(b, n, heads, c // heads).transpose(1, 2)
        with sdpa_kernel(COMFY_0364, set_priority=True):
            a = F.scaled_dot_product_attention(q, q, q)
        k = ctx.view(b, -1, heads, c // heads).transpose(1, 2)
        with sdpa_kernel(COMFY_033, set_priority=True):
            o = F.scaled_dot_product_attention(a, k, k)
        return o.transpose(1, 2).reshape(b, n, c)

    return both


def _attention(x, ctx):
    """Two attentions the way ComfyUI runs them on NVIDIA GPUs (self, then cross), with an
    op between them."""
    b, n, c = x.shape
    q = x.view(b, n, 2, c // 2).transpose(1, 2)
    with sdpa_kernel(COMFY_033, set_priority=True):
        a = F.scaled_dot_product_attention(q, q, q)
    a = a.transpose(1, 2).reshape(b, n, c) + x
    k = ctx.view(b, -1, 2, c // 2).transpose(1, 2)
    with sdpa_kernel(COMFY_033, set_priority=True):
        o = F.scaled_dot_product_attention(a.view(b, n, 2, c // 2).transpose(1, 2), k, k)
    return o.transpose(1, 2).reshape(b, n, c)


def _traced(fn, *args) -> torch.fx.GraphModule:
    got = []

    def backend(gm, example_inputs):
        got.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    (gm,) = got
    return gm


def _orders(gm) -> list[list[str]]:
    """Each ``_sdpa_kernel`` call's backends, in graph order."""
    return [
        [ac._backend_name(b) for b in n.args[0]]
        for n in gm.graph.nodes
        if ac._is_call(n, "_sdpa_kernel")
    ]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 16, 8, generator=g), torch.randn(2, 5, 8, generator=g)


class Timer:
    def __init__(self, ms: dict[str, float | None]):
        self.ms = ms
        self.calls: list[tuple[tuple, str]] = []

    def __call__(self, site, backend):
        self.calls.append((site.inputs, backend))
        return self.ms.get(backend)


def test_finds_each_attention_in_its_priority_block():
    gm = _traced(_attention, *_inputs())
    found = ac.sites(gm)
    assert len(found) == 2
    assert all(s.backends == tuple(b.name for b in COMFY_033) for s in found)
    assert found[0].inputs[0][0] == (2, 2, 16, 4) and found[1].inputs[1][0] == (2, 2, 5, 4)
    # each site's entering call is one of the graph's _sdpa_kernel calls, never a restoring one
    calls = [n for n in gm.graph.nodes if ac._is_call(n, "_sdpa_kernel")]
    assert len(calls) == 4 and [s.enter for s in found] == [calls[0], calls[2]]


def test_the_fastest_backend_goes_first_and_the_rest_keep_their_order():
    x, ctx = _inputs()
    gm = _traced(_attention, x, ctx)
    restore = _orders(gm)[1]
    want = _attention(x, ctx)
    timer = Timer({"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.5, "EFFICIENT_ATTENTION": 2.0})
    said = ac.AttentionBackendChoice(timer=timer, force=True)(gm)
    assert said == (
        "attention moved to the backend measured fastest: 2 on cudnn"
        " (2.00× as fast alone as ComfyUI's first choice)"
    )
    cudnn_first = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert _orders(gm) == [cudnn_first, restore, cudnn_first, restore]
    # the math backend is never timed; each distinct set of shapes once per backend
    assert {b for _, b in timer.calls} == set(ac.CANDIDATES)
    assert len(timer.calls) == 6
    torch.testing.assert_close(gm(x, ctx)[0], want, rtol=0, atol=0)  # CPU: the same kernel


@pytest.mark.parametrize(
    "ms",
    [
        {"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.98, "EFFICIENT_ATTENTION": 3.0},  # < 3%
        {"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": None, "EFFICIENT_ATTENTION": None},  # no kernel
        {"FLASH_ATTENTION": 0.5, "CUDNN_ATTENTION": 1.0, "EFFICIENT_ATTENTION": 1.0},
    ],
)
def test_comfyui_s_order_stays_unless_another_is_clearly_faster(ms):
    gm = _traced(_attention, *_inputs())
    before = _orders(gm)
    assert ac.AttentionBackendChoice(timer=Timer(ms), force=True)(gm) is None
    assert _orders(gm) == before


def test_the_choice_is_remembered_on_disk(tmp_path):
    path = tmp_path / "cache" / "attention.json"
    fast_cudnn = Timer({"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.5})
    ac.AttentionBackendChoice(cache_file=lambda: path, timer=fast_cudnn, force=True)(
        _traced(_attention, *_inputs())
    )
    assert fast_cudnn.calls and sorted(set(json.loads(path.read_text()).values())) == [
        "CUDNN_ATTENTION"
    ]
    # a new process: the same choice without timing, even if a timing now would differ
    fast_flash = Timer({"FLASH_ATTENTION": 0.1, "CUDNN_ATTENTION": 1.0})
    gm = _traced(_attention, *_inputs())
    said = ac.AttentionBackendChoice(cache_file=lambda: path, timer=fast_flash, force=True)(gm)
    assert not fast_flash.calls
    assert _orders(gm)[0][0] == "CUDNN_ATTENTION"
    assert said == "attention moved to the backend measured fastest: 2 on cudnn"  # not timed now
    # a damaged file is chosen again, not trusted
    path.write_text("{not json")
    again = Timer({"FLASH_ATTENTION": 0.1, "CUDNN_ATTENTION": 1.0})
    ac.AttentionBackendChoice(cache_file=lambda: path, timer=again, force=True)(
        _traced(_attention, *_inputs())
    )
    assert again.calls


def test_attention_outside_a_block_or_with_a_mask_or_on_the_cpu_is_left_alone():
    def bare(x):
        q = x.view(2, 16, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q)

    def masked(x):
        q = x.view(2, 16, 2, 4).transpose(1, 2)
        with sdpa_kernel(COMFY_033, set_priority=True):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16).bool())

    def small_between(x):  # ComfyUI 0.33 runs small attentions outside any block
        q = x.view(2, 16, 2, 4).transpose(1, 2)
        with sdpa_kernel(COMFY_033, set_priority=True):
            a = F.scaled_dot_product_attention(q, q, q)
        b = F.scaled_dot_product_attention(a, a, a)
        with sdpa_kernel(COMFY_033, set_priority=True):
            return F.scaled_dot_product_attention(b, b, b)

    x, ctx = _inputs()
    timer = Timer({"CUDNN_ATTENTION": 0.1, "FLASH_ATTENTION": 1.0})
    gm = _traced(small_between, x)
    restore = _orders(gm)[1]
    ac.AttentionBackendChoice(timer=timer, force=True)(gm)
    first = ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"]
    assert _orders(gm) == [first, restore, first, restore]  # the exits as they were
    assert len(ac.sites(gm)) == 2
    for fn, args in ((bare, (x,)), (masked, (x,))):
        gm = _traced(fn, *args)
        before = _orders(gm)
        assert ac.AttentionBackendChoice(timer=timer, force=True)(gm) is None
        assert _orders(gm) == before
    gm = _traced(_attention, x, ctx)  # CPU tensors, not forced: a GPU-only choice
    unused = Timer({"CUDNN_ATTENTION": 0.1, "FLASH_ATTENTION": 1.0})
    assert ac.AttentionBackendChoice(timer=unused)(gm) is None
    assert not unused.calls


def test_the_setting_is_auto_unless_asked_otherwise(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(ac, "_WARNED", set())
    monkeypatch.delenv(ac.ENV, raising=False)
    assert ac.mode() == ac.AUTO
    for value, want in (("", ac.AUTO), (" Auto", ac.AUTO), (" Fastest ", ac.ON), ("0", ac.OFF)):
        monkeypatch.setenv(ac.ENV, value)
        assert ac.mode() == want, value
    monkeypatch.setenv(ac.ENV, "OFF")
    assert ac.mode() == ac.OFF
    assert not caplog.records
    # a value that is not a setting: the default, said once, with the variable and the settings
    monkeypatch.setenv(ac.ENV, "cudnn")
    with caplog.at_level(logging.WARNING):
        assert ac.mode() == ac.AUTO and ac.mode() == ac.AUTO
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "CNA_COMPILE_ATTENTION='cudnn'" in said[0], said
    assert all(v in said[0] for v in ("auto", "fastest", "off")), said


def test_auto_times_only_the_attentions_comfyui_runs_on_flash_first():
    """ComfyUI 0.3.64 puts cuDNN first, 0.33 flash: the choice restricted to flash-first
    attentions leaves a cuDNN-first block as it is and moves the other; it shares the full
    choice's memory and is a setting of its own (compiled code is kept apart)."""
    mixed = _cudnn_then_flash(heads=2)
    x, ctx = _inputs()
    gm = _traced(mixed, x, ctx)
    before = _orders(gm)
    timer = Timer({"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 2.0, "EFFICIENT_ATTENTION": 0.5})
    every = ac.AttentionBackendChoice(timer=timer, force=True)
    auto = every.only_first(ac.AUTO_FROM)
    assert auto != every and hash(auto) != hash(every) and auto == every.only_first(ac.AUTO_FROM)
    said = auto(gm)
    assert said.startswith("attention moved to the backend measured fastest: 1 on efficient")
    after = _orders(gm)
    assert after[0] == before[0] == [b.name for b in COMFY_0364]  # cuDNN first: untimed
    assert after[2][0] == "EFFICIENT_ATTENTION" and after[1] == before[1]
    assert {site for site, _ in timer.calls} == {ac.sites(_traced(mixed, x, ctx))[1].inputs}
    # the full choice knows the flash-first site already and times only the other
    n = len(timer.calls)
    every(_traced(mixed, x, ctx))
    assert len(timer.calls) > n
    assert all(site == ac.sites(_traced(mixed, x, ctx))[0].inputs for site, _ in timer.calls[n:])


def test_a_file_keeps_what_other_processes_chose(tmp_path):
    path = tmp_path / "attention_backends.json"
    path.write_text(json.dumps({"another process's site": "CUDNN_ATTENTION"}))
    fast = Timer({"FLASH_ATTENTION": 1.0, "CUDNN_ATTENTION": 0.5})
    ac.AttentionBackendChoice(cache_file=lambda: path, timer=fast, force=True)(
        _traced(_attention, *_inputs())
    )
    kept = json.loads(path.read_text())
    assert kept["another process's site"] == "CUDNN_ATTENTION" and len(kept) == 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_times_real_backends_and_keeps_the_result():
    """On a GPU: the real timer gives a time for flash and cuDNN at an SD1.5 shape (fp16, batch
    2, 8 heads of 40) or None where a backend has no kernel; the compiled attention after the
    rewrite matches eager attention within fp16 rounding."""

    def sd15(x, ctx):
        b, n, c = x.shape
        q = x.view(b, n, 8, c // 8).transpose(1, 2)
        k = ctx.view(b, -1, 8, c // 8).transpose(1, 2)
        with sdpa_kernel(COMFY_033, set_priority=True):
            o = F.scaled_dot_product_attention(q, k, k)
        return o.transpose(1, 2).reshape(b, n, c)

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4096, 320, device="cuda", dtype=torch.float16, generator=g)
    ctx = torch.randn(2, 4096, 320, device="cuda", dtype=torch.float16, generator=g)
    gm = _traced(sd15, x, ctx)
    (site,) = ac.sites(gm)
    ms = {b: ac.time_backend(site, b) for b in ac.CANDIDATES}
    assert ms["FLASH_ATTENTION"] is not None and ms["FLASH_ATTENTION"] > 0, ms
    ac.AttentionBackendChoice()(gm)
    ref = sd15(x, ctx).float()
    got = gm(x, ctx)[0].float()
    assert (got - ref).norm() / ref.norm() < 1e-2, ms


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_auto_times_only_flash_first_attentions():
    """On a GPU, the default setting: of an SD1.5-shaped attention in a cuDNN-first block
    (ComfyUI 0.3.64) and one in a flash-first block (0.33), only the second is timed and may
    move; the rewritten graph matches eager attention within fp16 rounding."""
    both = _cudnn_then_flash(heads=8)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2, 4096, 320, device="cuda", dtype=torch.float16, generator=g)
    ctx = torch.randn(2, 77, 320, device="cuda", dtype=torch.float16, generator=g)
    gm = _traced(both, x, ctx)
    timed = []

    def timer(site, backend):
        timed.append(site.inputs)
        return ac.time_backend(site, backend)

    auto = ac.AttentionBackendChoice(timer=timer).only_first(ac.AUTO_FROM)
    auto(gm)
    first, second = ac.sites(_traced(both, x, ctx))
    assert timed and set(timed) == {second.inputs}
    assert _orders(gm)[0] == [b.name for b in COMFY_0364]
    ref = both(x, ctx).float()
    got = gm(x, ctx)[0].float()
    assert (got - ref).norm() / ref.norm() < 1e-2


def test_chosen_inside_a_real_compile(tmp_path):
    """The pass as compiled mode runs it: inside a torch.compile of the pack's CompiledModule,
    the real timer making and running real tensors during the compile. On the CPU only flash
    attention has a kernel: the others time as None, ComfyUI's order stays, the result is
    eager's and the choice is written down."""
    from comfyui_controlnet_accelerator.graphs.compiled import CompiledModule, CompileOptions

    class Attn(torch.nn.Module):
        def forward(self, x, ctx):
            return _attention(x, ctx)

    seen = []

    def timer(site, backend):
        seen.append((backend, ac.time_backend(site, backend, iters=2)))
        return seen[-1][1]

    path = tmp_path / "attention.json"
    choice = ac.AttentionBackendChoice(cache_file=lambda: path, timer=timer, force=True)
    opts = CompileOptions(backend="aot_eager", graph_passes=(choice,))
    torch._dynamo.reset()
    x, ctx = _inputs()
    module = Attn()  # held: the compiled module keeps a weak reference
    got = CompiledModule(module, "attention", opts)(x, ctx)
    torch.testing.assert_close(got, _attention(x, ctx))
    ms = dict(seen)
    assert ms["FLASH_ATTENTION"] > 0 and ms["CUDNN_ATTENTION"] is None, seen
    assert set(json.loads(path.read_text()).values()) == {"FLASH_ATTENTION"}
