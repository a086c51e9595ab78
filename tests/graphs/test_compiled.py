# SPDX-License-Identifier: GPL-3.0-or-later
"""Compiled mode's core (graphs/compiled.py), no ComfyUI needed.

Inductor really compiles here (C++ on the CPU): the stand-ins are tiny and the module shares
three compiles between its tests, with one compile thread and plain (non-SIMD) C++ so that a
compile takes seconds on a small CI machine. Bookkeeping that does not depend on what inductor
generates (signatures, LRU, refusals, logging) uses dynamo's ``eager`` backend, which traces the
same way and compiles nothing. The ``cuda`` tests capture compiled code in ``GraphCache``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from comfyui_controlnet_accelerator.graphs import GraphCache
from comfyui_controlnet_accelerator.graphs import compiled as C
from torch import nn

CUDA = torch.cuda.is_available()
LOGGER = "ControlNetAccelerator"
ROOT = Path(__file__).resolve().parents[2]


# -- stand-ins shaped like the UNet and a ControlNet (GroupNorm, SiLU, conv, cross-attention) ------


def attention(q, k, v):
    """SDPA as ComfyUI calls it on NVIDIA GPUs: inside ``sdpa_kernel`` with a backend priority
    (dynamo records that context in the graph, which the compile cache must accept)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    priority = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(priority, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Block(nn.Module):
    """ResBlock + cross-attention, as in an SD UNet level."""

    def __init__(self, ch: int = 32, ctx: int = 24, emb: int = 32):
        super().__init__()
        self.norm1 = nn.GroupNorm(8, ch)
        self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
        self.emb = nn.Linear(emb, ch)
        self.norm2 = nn.GroupNorm(8, ch)
        self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)
        self.norm3 = nn.LayerNorm(ch)
        self.q = nn.Linear(ch, ch, bias=False)
        self.k = nn.Linear(ctx, ch, bias=False)
        self.v = nn.Linear(ctx, ch, bias=False)
        self.out = nn.Linear(ch, ch)

    def forward(self, x, emb, context):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(F.silu(emb))[:, :, None, None]
        x = x + self.conv2(F.silu(self.norm2(h)))
        b, c, hh, ww = x.shape
        tok = self.norm3(x.flatten(2).transpose(1, 2))
        q = self.q(tok).view(b, -1, 4, c // 4).transpose(1, 2)
        k = self.k(context).view(b, -1, 4, c // 4).transpose(1, 2)
        v = self.v(context).view(b, -1, 4, c // 4).transpose(1, 2)
        a = attention(q, k, v).transpose(1, 2).reshape(b, -1, c)
        return x + self.out(a).transpose(1, 2).reshape(b, c, hh, ww)


class TinyUNet(nn.Module):
    """forward(x, timesteps, context, control, strength): ComfyUI's UNet call, with the
    ControlNet's residuals added (times a strength tensor) after each level."""

    def __init__(self, ch: int = 32):
        super().__init__()
        self.ch = ch
        self.time = nn.Sequential(nn.Linear(ch, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.conv_in = nn.Conv2d(4, ch, 3, padding=1)
        self.down = Block(ch)
        self.pool = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.mid = Block(ch)
        self.up = nn.Conv2d(2 * ch, ch, 3, padding=1)
        self.norm_out = nn.GroupNorm(8, ch)
        self.conv_out = nn.Conv2d(ch, 4, 3, padding=1)

    def forward(self, x, timesteps, context, control, strength):
        emb = self.time(timestep_embedding(timesteps, self.ch).to(x.dtype))
        h0 = self.down(self.conv_in(x), emb, context) + strength * control[0]
        h1 = self.mid(self.pool(h0), emb, context) + strength * control[1]
        h = F.interpolate(h1, scale_factor=2.0, mode="nearest")
        h = self.up(torch.cat([h, h0], dim=1))
        return self.conv_out(F.silu(self.norm_out(h)))


class TinyControlNet(nn.Module):
    """forward(x, hint, timesteps, context) -> a list of residuals, one per UNet level."""

    def __init__(self, ch: int = 32):
        super().__init__()
        self.ch = ch
        self.time = nn.Sequential(nn.Linear(ch, ch), nn.SiLU(), nn.Linear(ch, ch))
        self.hint = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, ch, 1))
        self.conv_in = nn.Conv2d(4, ch, 3, padding=1)
        self.block = Block(ch)
        self.pool = nn.Conv2d(ch, ch, 3, stride=2, padding=1)
        self.zero0 = nn.Conv2d(ch, ch, 1)
        self.zero1 = nn.Conv2d(ch, ch, 1)

    def forward(self, x, hint, timesteps, context):
        emb = self.time(timestep_embedding(timesteps, self.ch).to(x.dtype))
        h = self.block(self.conv_in(x) + self.hint(hint), emb, context)
        return [self.zero0(h), self.zero1(self.pool(h))]


def unet_inputs(batch=2, size=8, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    x = r(batch, 4, size, size)
    t = torch.rand(batch, generator=g).to(device) * 999
    context = r(batch, 7, 24)
    control = [r(batch, 32, size, size), r(batch, 32, size // 2, size // 2)]
    strength = torch.tensor(0.8, device=device, dtype=dtype)
    return x, t, context, control, strength


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# -- shared inductor setup and compiles -----------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Inductor kept light for a 2-core machine, writing to this module's own cache folder."""
    import torch._inductor.config as ic

    saved = (ic.compile_threads, ic.cpp.vec_isa_ok)
    ic.compile_threads = 1
    ic.cpp.vec_isa_ok = False
    folder = tmp_path_factory.mktemp("inductor")
    with pytest.MonkeyPatch.context() as mp:
        for name in (C.TORCH_CACHE_ENV, C.CACHE_ENV):
            mp.setenv(name, "unset")  # so that leaving the context removes what the pack set
            mp.delenv(name)
        yield folder
    ic.compile_threads, ic.cpp.vec_isa_ok = saved


@pytest.fixture(scope="module")
def unet(cache_dir):
    """The stand-in UNet compiled once at batch 2, 8x8 (the module's first compile)."""
    torch.manual_seed(0)
    module = TinyUNet().eval().requires_grad_(False)
    events: list[C.CompileProgress] = []
    cm = C.CompiledModule(
        module, "UNet", C.CompileOptions(cache_dir=str(cache_dir)), on_progress=events.append
    )
    graphs0 = _unique_graphs()
    inputs = unet_inputs()  # made outside inference mode, like every test's inputs
    with torch.inference_mode():
        out = cm(*inputs)
    fresh = unet_inputs(seed=1)
    with torch.inference_mode():
        assert cm.compiles == 1 and cm.is_compiled(*fresh)
    return {"module": module, "cm": cm, "events": events, "first_out": out, "graphs0": graphs0}


def run(fn, inputs):
    with torch.inference_mode():
        return fn(*inputs)


# -- inductor: parity, one compile per shape, none per value --------------------------------------


def test_compiled_unet_matches_eager_on_fresh_inputs(unet):
    cm, module = unet["cm"], unet["module"]
    for seed in (1, 2, 3):
        inputs = unet_inputs(seed=seed)
        with torch.inference_mode():
            p = C.check_parity(cm, module, inputs)
        assert p.ok, p.reason
        assert p.rel_err < 1e-4 and p.max_abs < 1e-3
    assert cm.compiles == 1 and cm.eager_calls == 0


def test_changed_values_strength_and_weights_cost_no_compile(unet):
    cm, module = unet["cm"], unet["module"]
    graphs = (cm.graphs, _unique_graphs())
    for seed in (4, 5):
        x, t, context, control, _ = unet_inputs(seed=seed)
        for s in (0.0, 0.5, 1.3):
            inputs = (x, t, context, control, torch.tensor(s))
            torch.testing.assert_close(run(cm, inputs), run(module, inputs), rtol=1e-4, atol=1e-4)
    # a LoRA re-patch: ComfyUI puts new Parameters (same shape, no grad) on the module
    old = module.conv_in.weight
    module.conv_in.weight = nn.Parameter(old * 1.5 + 0.01, requires_grad=False)
    try:
        inputs = unet_inputs(seed=6)
        got, want = run(cm, inputs), run(module, inputs)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        with torch.inference_mode():  # and the new weights really are the ones read
            assert not torch.allclose(got, run_with_weight(module, old, inputs), atol=1e-3)
    finally:
        module.conv_in.weight = old
    assert (cm.graphs, _unique_graphs()) == graphs
    assert cm.compiles == 1 and cm.recompiles == 0 and not cm.failed


def run_with_weight(module, weight, inputs):
    new = module.conv_in.weight
    module.conv_in.weight = weight
    try:
        return module(*inputs)
    finally:
        module.conv_in.weight = new


def test_new_shape_compiles_once_and_old_shape_not_again(unet):
    cm, module = unet["cm"], unet["module"]
    events = unet["events"]
    events.clear()
    small = unet_inputs(batch=1, size=12, seed=7)
    for seed in (7, 8):
        inputs = unet_inputs(batch=1, size=12, seed=seed)
        torch.testing.assert_close(run(cm, inputs), run(module, inputs), rtol=1e-4, atol=1e-4)
    assert cm.compiles == 2
    run(cm, unet_inputs(seed=9))  # back to the first shape: compiled already
    assert cm.compiles == 2 and len(cm.entries) == 2
    phases = [e.phase for e in events]
    assert phases[0] == "start" and phases[-1] == "done" and "lowering" in phases
    assert all(e.signature.startswith("1x4x12x12 float32 cpu") for e in events)
    assert all(e.name == "UNet" for e in events)
    assert events[-1].elapsed_s > 0 and events[-1].graphs == 1
    with torch.inference_mode():
        assert cm.is_compiled(*small)
    assert not cm.is_compiled(*small)  # grad mode is part of the signature


def test_controlnet_stand_in_list_output_matches_eager(cache_dir):
    torch.manual_seed(1)
    cn = TinyControlNet().eval().requires_grad_(False)
    cm = C.CompiledModule(cn, "ControlNet 1", C.CompileOptions(cache_dir=str(cache_dir)))
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        inputs = (
            torch.randn(2, 4, 8, 8, generator=g),
            torch.randn(2, 3, 8, 8, generator=g),  # the hint
            torch.rand(2, generator=g) * 999,
            torch.randn(2, 7, 24, generator=g),
        )
        with torch.inference_mode():
            p = C.check_parity(cm, cn, inputs)
        assert p.ok, p.reason
    assert cm.compiles == 1 and cm.graphs == 1


def test_compile_cache_files_land_in_the_folder(unet, cache_dir):
    assert os.environ.get(C.TORCH_CACHE_ENV) == os.path.abspath(cache_dir)
    fx = cache_dir / "fxgraph"
    assert fx.is_dir() and any(p.is_file() for p in fx.rglob("*")), sorted(cache_dir.iterdir())


def test_restart_with_warm_cache_hits_the_fx_graph_cache(cache_dir, tmp_path):
    """Two fresh processes compile the same ControlNet stand-in and shape into one folder (set
    through the pack's own variable, as a user would): the second reads the first's work, from
    AOTAutograd's cache as well as inductor's."""
    script = textwrap.dedent(
        f"""
        import importlib.util, json, sys, torch
        import torch._inductor.config as ic
        ic.compile_threads = 1
        ic.cpp.vec_isa_ok = False
        spec = importlib.util.spec_from_file_location(
            "comfyui_controlnet_accelerator", {str(ROOT / "__init__.py")!r},
            submodule_search_locations=[{str(ROOT)!r}])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = pack
        spec.loader.exec_module(pack)
        spec = importlib.util.spec_from_file_location("standins", {__file__!r})
        t = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = t
        spec.loader.exec_module(t)
        from comfyui_controlnet_accelerator.graphs import compiled as C
        from torch._dynamo.utils import counters
        cn = t.TinyControlNet().eval().requires_grad_(False)
        cm = C.CompiledModule(cn, "ControlNet", C.CompileOptions())
        inputs = (torch.randn(2, 4, 8, 8), torch.randn(2, 3, 8, 8), torch.rand(2) * 999,
                  torch.randn(2, 7, 24))
        with torch.inference_mode():
            ok = C.check_parity(cm, cn, inputs).ok
        print(json.dumps({{"compiles": cm.compiles, "compile_s": cm.compile_s, "parity": ok,
                          "inductor": dict(counters["inductor"]),
                          "aot": dict(counters["aot_autograd"])}}))
        """
    )
    folder = tmp_path / "restart"
    env = {k: v for k, v in os.environ.items() if k != C.TORCH_CACHE_ENV}
    env[C.CACHE_ENV] = str(folder)
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    runs = []
    for _ in range(2):
        res = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=400
        )
        assert res.returncode == 0, res.stderr[-3000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] == warm["compiles"] == 1 and cold["parity"] and warm["parity"]
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 1, cold
    assert warm["inductor"].get("fxgraph_cache_hit", 0) >= 1, warm
    assert warm["inductor"].get("fxgraph_cache_miss", 0) == 0, warm
    # AOTAutograd's cache takes the graph (attention inside sdpa_kernel included), so a restart
    # skips AOTAutograd's trace of the network too, not only inductor's code generation
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1, cold
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1, warm
    assert not cold["aot"].get("autograd_cache_bypass") and not warm["aot"].get(
        "autograd_cache_bypass"
    ), (cold, warm)
    assert (folder / "fxgraph").is_dir()
    assert warm["compile_s"] < cold["compile_s"], (warm["compile_s"], cold["compile_s"])


# -- failures fall back to eager, reason logged once ----------------------------------------------


def test_inductor_failure_falls_back_to_eager_and_logs_once(cache_dir, monkeypatch, caplog):
    import torch._inductor.compile_fx as cfx

    def broken(*a, **k):
        raise RuntimeError("injected lowering failure")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    lin = nn.Sequential(nn.Linear(8, 8), nn.GELU()).requires_grad_(False)
    events = []
    cm = C.CompiledModule(
        lin, "UNet", C.CompileOptions(cache_dir=str(cache_dir)), on_progress=events.append
    )
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        for shape in ((2, 8), (2, 8), (3, 8)):
            x = torch.randn(*shape)
            torch.testing.assert_close(cm(x), lin(x))
    warnings = [r.getMessage() for r in caplog.records if "injected lowering failure" in r.message]
    assert len(warnings) == 1, warnings
    assert "running eager" in warnings[0] and "UNet" in warnings[0]
    assert len(cm.failed) == 2 and not cm.entries and cm.compiles == 0
    # the failed signature is not retried: one attempt per signature
    assert [e.phase for e in events].count("start") == 2
    assert events[-1].phase == "failed" and "injected" in events[-1].detail


def test_untraceable_module_with_fullgraph_falls_back(cache_dir, caplog):
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum().item() > 0:  # a host read of a value: no single graph
                return x * 2
            return x - 1

    m = DataDependent()
    cm = C.CompiledModule(m, "ControlNet", C.CompileOptions(fullgraph=True, backend="eager"))
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        for _ in range(3):
            x = torch.ones(4)
            assert torch.equal(cm(x), m(x))
    assert len(cm.failed) == 1
    reason = next(iter(cm.failed.values()))
    assert reason.startswith("compile failed:")
    assert sum("running eager" in r.message for r in caplog.records) == 1


def test_a_value_dynamo_specialised_on_gives_the_signature_up(caplog):
    lin = nn.Linear(4, 4).requires_grad_(False)

    def scaled(x, s):
        return lin(x) * s

    cm = C.CompiledModule(scaled, "UNet", C.CompileOptions(backend="eager"))
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        cm(x, 0.5)
        assert cm.compiles == 1
        for s in (0.7, 0.9):  # Python numbers are guarded on: not recompiled, eager instead
            torch.testing.assert_close(cm(x, s), lin(x) * s)
    assert cm.compiles == 1 and cm.recompiles == 0 and not cm.entries
    reason = next(iter(cm.failed.values()))
    assert "would recompile" in reason and "0.5" in reason and "tensors" in reason
    assert sum("would recompile" in r.message for r in caplog.records) == 1


def test_verify_gives_up_a_signature_whose_compiled_output_differs(caplog):
    class CompilesDifferently(nn.Module):
        def forward(self, x):
            if torch.compiler.is_compiling():
                return x + 1e-2
            return x

    m = CompilesDifferently()
    cm = C.CompiledModule(m, "UNet", C.CompileOptions(backend="eager"))
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        p = cm.verify(x, tol=1e-4)
        assert not p.ok and p.rel_err > 1e-4 and "relative L2" in p.reason
        assert torch.equal(cm(x), x)  # eager from now on
    assert not cm.entries and "verify" in next(iter(cm.failed.values()))
    assert sum("verify" in r.message for r in caplog.records) == 1


def test_compiler_unavailable_is_one_clear_reason(monkeypatch, caplog):
    import torch.utils._triton as tt

    monkeypatch.setattr(tt, "has_triton", lambda: False)
    assert "Triton" in C.unavailable_reason(torch.device("cuda"))
    assert C.unavailable_reason(torch.device("cuda"), backend="eager") is None
    monkeypatch.setattr(C, "unavailable_reason", lambda device, backend: "no compiler here")
    lin = nn.Linear(4, 4)
    cm = C.CompiledModule(lin, "UNet")
    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        x = torch.randn(2, 4)
        torch.testing.assert_close(cm(x), lin(x))
        cm(x)
    assert list(cm.failed.values()) == ["no compiler here"] and cm.graphs == 0
    assert sum("no compiler here" in r.message for r in caplog.records) == 1


# -- no compile where a capture runs --------------------------------------------------------------


def test_no_compile_refuses_new_signatures_and_recompiles_without_giving_them_up():
    lin = nn.Linear(4, 4).requires_grad_(False)

    def scaled(x, s):
        return lin(x) * s

    cm = C.CompiledModule(scaled, "UNet", C.CompileOptions(backend="eager"))
    x = torch.randn(2, 4)
    with torch.inference_mode():
        with C.no_compile():
            assert C.compile_forbidden() == "inside no_compile()"
            with pytest.raises(C.CompileNotReady, match="call it once outside first"):
                cm(x, 0.5)
        assert C.compile_forbidden() is None
        cm(x, 0.5)  # compiled outside
        with C.no_compile():
            torch.testing.assert_close(cm(x, 0.5), lin(x) * 0.5)  # compiled code runs
            with pytest.raises(C.CompileNotReady, match="would recompile"):
                cm(x, 0.25)
    assert cm.entries and not cm.failed and cm.compiles == 1 and cm.graphs == 1


# -- bookkeeping ----------------------------------------------------------------------------------


def test_the_compile_log_splits_the_backends_time_from_the_rest(caplog):
    import re
    import time

    def slow_pass(gm):
        time.sleep(0.3)  # stands in for a slow lowering

    lin = nn.Linear(4, 4).requires_grad_(False)
    opts = C.CompileOptions(backend="eager", graph_passes=(slow_pass,))
    cm = C.CompiledModule(lin, "UNet", opts)
    with caplog.at_level(logging.INFO, logger=LOGGER), torch.inference_mode():
        cm(torch.randn(2, 4))
    assert 0.3 <= cm.backend_s <= cm.compile_s
    line = next(r.getMessage() for r in caplog.records if "compiled for" in r.message)
    total, backend, rest = map(
        float,
        re.search(r"in ([\d.]+) s .*; ([\d.]+) s compiling.*, ([\d.]+) s tracing", line).groups(),
    )
    assert backend >= 0.3 and abs(total - backend - rest) <= 0.11


class Repeated(nn.Module):
    """Four blocks of one width and size after a stem: four repeats of one region."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(4, 32, 3, padding=1)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x, emb, context):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x, emb, context)
        return x


def _regions_seen(dedupe: bool, backend: str = "eager", cache_dir=None):
    """Compile ``Repeated`` with or without region dedupe; returns (output, eager output, calls
    of a region in the top graph, the graphs the pass was handed)."""
    torch.manual_seed(0)
    net = Repeated().eval().requires_grad_(False)
    args = (torch.randn(2, 4, 8, 8), torch.randn(2, 32), torch.randn(2, 5, 24))
    seen = []

    def count(gm):
        seen.append(gm)

    opts = C.CompileOptions(
        backend=backend,
        dedupe_regions=dedupe,
        graph_passes=(count,),
        cache_dir=None if cache_dir is None else str(cache_dir),
    )
    cm = C.CompiledModule(net, "UNet", opts)
    with torch.inference_mode():
        want = net(*args)
        got = cm(*args)
    calls = [n for n in seen[0].graph.nodes if "invoke_subgraph" in str(n.target)]
    return got, want, len(calls), seen


@pytest.mark.skipif(not C.dedupe_available(), reason="this torch has no region dedupe")
def test_region_dedupe_calls_one_subgraph_for_the_repeated_blocks_and_passes_see_it():
    got, want, calls, seen = _regions_seen(True)
    assert calls == 4 and torch.equal(got, want)
    regions = seen[1:]
    assert len(regions) == 1  # one region graph, handed to each pass once
    ops = [n for n in regions[0].graph.nodes if n.op == "call_function"]
    assert any("scaled_dot_product_attention" in str(n.target) for n in ops)
    got, want, calls, seen = _regions_seen(False)
    assert calls == 0 and len(seen) == 1 and torch.equal(got, want)


@pytest.mark.skipif(not C.dedupe_available(), reason="this torch has no region dedupe")
def test_region_dedupe_with_inductor_matches_eager(cache_dir):
    got, want, calls, _ = _regions_seen(True, backend="inductor", cache_dir=cache_dir)
    assert calls == 4
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class Small(nn.Module):
    """A four-op pattern (linear, scale, shift, tanh) four times over: regions too small to
    keep."""

    def __init__(self):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for lin in self.lins:
            x = torch.tanh(lin(x) * 2 + 1)
        return x


@pytest.mark.skipif(
    not C.dedupe_available() or C._inliner() is None,
    reason="this torch has no region dedupe or cannot put regions back inline",
)
def test_regions_under_the_minimum_size_are_put_back_inline(caplog):
    torch.manual_seed(0)
    net = Small().eval().requires_grad_(False)
    x = torch.randn(3, 8)
    seen = []
    opts = C.CompileOptions(backend="eager", dedupe_regions=True, graph_passes=(seen.append,))
    cm = C.CompiledModule(net, "UNet", opts)
    with caplog.at_level(logging.INFO, logger=LOGGER), torch.inference_mode():
        got, want = cm(x), net(x)
    assert torch.equal(got, want)
    (gm,) = seen  # no region graph left to hand to the passes
    assert not C._invoke_subgraph_nodes(gm)
    said = next(r.getMessage() for r in caplog.records if "regions" in r.getMessage())
    assert "0 repeated regions compiled once for 0 calls (4 calls of regions under" in said


@pytest.mark.skipif(not C.dedupe_available(), reason="this torch has no region dedupe")
def test_small_regions_a_torch_cannot_inline_stay_and_one_line_says_so(monkeypatch, caplog):
    monkeypatch.setattr(C, "_inliner", lambda: None)  # a torch without the pass (2.11)
    torch.manual_seed(0)
    net = Small().eval().requires_grad_(False)
    seen = []
    opts = C.CompileOptions(backend="eager", dedupe_regions=True, graph_passes=(seen.append,))
    cm = C.CompiledModule(net, "UNet", opts)
    with caplog.at_level(logging.INFO, logger=LOGGER), torch.inference_mode():
        for rows in (3, 5):  # two signatures, two traces: said once
            x = torch.randn(rows, 8)
            assert torch.equal(cm(x), net(x))
    assert all(len(C._invoke_subgraph_nodes(gm)) == 4 for gm in seen[:1])  # the regions stayed
    said = [r.getMessage() for r in caplog.records if "cannot put regions back" in r.getMessage()]
    assert len(said) == 1 and "4 calls of regions under 8 ops stay regions" in said[0], said


def test_without_region_dedupe_in_torch_one_line_says_so(monkeypatch, caplog):
    monkeypatch.setattr(C, "dedupe_available", lambda: False)
    torch.manual_seed(0)
    net = Repeated().eval().requires_grad_(False)
    seen = []
    opts = C.CompileOptions(backend="eager", dedupe_regions=True, graph_passes=(seen.append,))
    cm = C.CompiledModule(net, "UNet", opts)
    with caplog.at_level(logging.INFO, logger=LOGGER), torch.inference_mode():
        for size in (8, 12):  # two signatures, two traces: said once
            args = (torch.randn(2, 4, size, size), torch.randn(2, 32), torch.randn(2, 5, 24))
            assert torch.equal(cm(*args), net(*args))
    assert len(seen) == 2 and not any(C._invoke_subgraph_nodes(gm) for gm in seen)
    said = [r.getMessage() for r in caplog.records if "repeated regions" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("UNet: this torch cannot")


def test_compile_workers_are_started_before_dynamo_traces(monkeypatch):
    events = []
    monkeypatch.setattr(
        C, "start_compile_workers", lambda device, backend: events.append(("workers", device.type))
    )
    lin = nn.Linear(4, 4).requires_grad_(False)
    cm = C.CompiledModule(
        lin, "UNet", C.CompileOptions(backend="eager"), on_progress=lambda e: events.append(e.phase)
    )
    with torch.inference_mode():
        cm(torch.randn(2, 4))
        cm(torch.randn(2, 4))  # compiled already: nothing to start
    assert events == [("workers", "cpu"), "start", "lowering", "lowered", "done"]


def test_compile_workers_start_only_for_inductor_on_cuda(monkeypatch):
    import torch._inductor.async_compile as async_compile

    calls = []
    monkeypatch.setattr(async_compile, "maybe_warm_pool", lambda: calls.append(1))
    assert not C.start_compile_workers(torch.device("cpu"))
    assert not C.start_compile_workers(torch.device("cuda", 0), "aot_eager")
    assert calls == []
    assert C.start_compile_workers(torch.device("cuda", 0))
    assert calls == [1]

    def broken():
        raise RuntimeError("no worker pool here")

    monkeypatch.setattr(async_compile, "maybe_warm_pool", broken)
    assert not C.start_compile_workers(torch.device("cuda", 0))  # inductor starts it later


def test_a_max_autotune_compile_says_up_front_that_it_takes_many_minutes(caplog):
    lin = nn.Linear(4, 4).requires_grad_(False)
    for mode, said in (("max-autotune-no-cudagraphs", True), ("default", False)):
        caplog.clear()
        cm = C.CompiledModule(lin, "UNet", C.CompileOptions(backend="eager", mode=mode))
        with caplog.at_level(logging.INFO, logger=LOGGER), torch.inference_mode():
            cm(torch.randn(2, 4))
        line = next(r.getMessage() for r in caplog.records if "compiling for" in r.message)
        assert ("many minutes" in line) is said, line


def test_lru_keeps_max_shapes_and_evicted_shapes_compile_again():
    lin = nn.Linear(4, 4).requires_grad_(False)
    cm = C.CompiledModule(lin, "UNet", C.CompileOptions(backend="eager"), max_shapes=2)
    with torch.inference_mode():
        for b in (1, 2, 1, 3):  # 2 was used least recently when 3 arrives
            cm(torch.randn(b, 4))
        assert [e.label.split()[0] for e in cm.entries.values()] == ["1x4", "3x4"]
        assert cm.compiles == 3
        cm(torch.randn(2, 4))
    assert cm.compiles == 4 and len(cm.entries) == 2


def test_dynamic_policy_one_compile_for_many_sizes():
    conv = nn.Conv2d(4, 8, 3, padding=1).requires_grad_(False)
    cm = C.CompiledModule(conv, "UNet", C.CompileOptions(backend="eager", dynamic="dynamic"))
    with torch.inference_mode():
        for size in (8, 16, 24, 16):
            x = torch.randn(2, 4, size, size)
            torch.testing.assert_close(cm(x), conv(x))
    assert cm.compiles == 1 and cm.recompiles == 0 and len(cm.entries) == 1


def test_signature_ignores_values_and_sees_shapes_dtypes_layouts_and_modes():
    a = torch.randn(2, 4, 8, 8)
    sig = C.signature((a,), {"s": 0.5})
    assert C.signature((torch.zeros(2, 4, 8, 8),), {"s": 0.7}) == sig
    assert C.signature((torch.zeros(2, 4, 8, 16),), {"s": 0.5}) != sig
    assert C.signature((a.half(),), {"s": 0.5}) != sig
    assert C.signature((a.to(memory_format=torch.channels_last),), {"s": 0.5}) != sig
    assert C.signature((a,), {"s": None}) != sig
    assert C.signature((a,), {"t": 0.5}) != sig
    with torch.inference_mode():
        assert C.signature((a,), {"s": 0.5}) != sig
    dyn = C.signature((a,), {}, "dynamic")
    assert C.signature((torch.zeros(2, 4, 16, 24),), {}, "dynamic") == dyn
    assert C.signature((torch.zeros(1, 4, 16, 24),), {}, "dynamic") != dyn  # size 1 specialises


class _Residuals(dict):
    """A dict subclass with methods of its own, like the residuals joined on use."""

    def items(self):
        raise AssertionError("the signature must not call the dict's own methods")

    values = items


def test_signature_sees_inside_a_dict_subclass_without_calling_its_methods():
    a, b = torch.randn(2, 4, 8, 8), torch.randn(2, 8, 4, 4)

    def sig(d):
        return C.signature((a,), {"control": d})

    base = sig(_Residuals({"middle": [b], "output": [a]}))
    assert sig(_Residuals({"middle": [b.clone()], "output": [a + 1]})) == base  # values: same
    assert sig(_Residuals({"middle": [b[:1]], "output": [a]})) != base  # a residual's shape
    assert sig(_Residuals({"middle": [b], "output": [a, a]})) != base  # how many
    assert sig({"middle": [b], "output": [a]}) != base  # a plain dict: other code, other key


def test_untraced_is_one_object_per_function_and_breaks_the_graph():
    seen = []

    def note(x):
        seen.append(x.shape)

    assert C.untraced(note) is C.untraced(note)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def f(x):
        y = x * 2
        C.untraced(note)(y)
        return y + 1

    torch._dynamo.reset()
    out = torch.compile(f, backend=backend)(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0)) and seen == [(3,)]
    assert len(graphs) == 2  # the call ran as Python between two graphs


def test_module_is_held_weakly_and_cache_drops_dead_modules():
    import gc

    cache = C.CompileCache(C.CompileOptions(backend="eager"), max_modules=2)
    a, b, c = (nn.Linear(4, 4).requires_grad_(False) for _ in range(3))
    cma = cache.get(a, "ControlNet a")
    assert cache.get(a, "ControlNet a") is cma
    with torch.inference_mode():
        cma(torch.randn(2, 4))
    cache.get(b, "ControlNet b")
    cache.get(c, "ControlNet c")  # a is the least recently used: dropped and reset
    assert [m.name for m in cache.modules()] == ["ControlNet b", "ControlNet c"]
    assert not cma.entries
    del b
    gc.collect()
    assert [m.name for m in cache.modules()] == ["ControlNet c"]
    cm = C.CompiledModule(c, "c", C.CompileOptions(backend="eager"))
    del c
    gc.collect()
    assert cm.target is None
    with pytest.raises(ReferenceError):
        cm(torch.randn(2, 4))


def test_reset_and_clone():
    lin = nn.Linear(4, 4).requires_grad_(False)
    cm = C.CompiledModule(lin, "UNet", C.CompileOptions(backend="eager"), max_shapes=3)
    with torch.inference_mode():
        cm(torch.randn(2, 4))
    twin = cm.clone()
    assert twin.target is lin and twin.options == cm.options and twin.max_shapes == 3
    assert not twin.entries and cm.entries
    cm.failed["k"] = "x"
    cm.reset()
    assert not cm.entries and not cm.failed
    cache = C.CompileCache(C.CompileOptions(backend="eager"))
    cache.get(lin, "UNet")
    assert cache.clone().modules() == [] and cache.modules()
    cache.reset()
    assert cache.modules() == []


def test_progress_callback_errors_never_break_a_compile():
    def bad(event):
        raise RuntimeError("progress bar gone")

    lin = nn.Linear(4, 4).requires_grad_(False)
    cm = C.CompiledModule(lin, "UNet", C.CompileOptions(backend="eager"), on_progress=bad)
    with torch.inference_mode():
        x = torch.randn(2, 4)
        torch.testing.assert_close(cm(x), lin(x))
    assert cm.compiles == 1 and not cm.failed


def test_check_parity_reports_mismatches():
    x = torch.randn(16)
    same = C.check_parity(lambda v: v * 2, lambda v: v * 2, (x,))
    assert same.ok and same.rel_err == 0.0 and same.tol == C.PARITY_TOL[torch.float32]
    off = C.check_parity(lambda v: v * 2 + 1e-2, lambda v: v * 2, (x,))
    assert not off.ok and off.rel_err > off.tol and "relative L2" in off.reason
    shape = C.check_parity(lambda v: [v, v], lambda v: [v], (x,))
    assert not shape.ok and "structure" in shape.reason
    nan = C.check_parity(lambda v: v * float("nan"), lambda v: v, (x,))
    assert not nan.ok and "NaN" in nan.reason

    def raises(v):
        raise RuntimeError("boom")

    err = C.check_parity(raises, lambda v: v, (x,))
    assert not err.ok and "boom" in err.reason


# -- options, a module compiled by TorchCompileModel, the cache folder ----------------------------


def test_options_validate_and_never_turn_inductor_cudagraphs_on():
    with pytest.raises(ValueError, match="reduce-overhead"):
        C.CompileOptions(mode="reduce-overhead")
    with pytest.raises(ValueError, match="dynamic"):
        C.CompileOptions(dynamic="auto")
    cfg = C.CompileOptions(
        mode="max-autotune-no-cudagraphs",
        inductor_options=(("triton.cudagraphs", True), ("epilogue_fusion", False)),
    ).inductor_config()
    assert cfg["triton.cudagraphs"] is False and cfg["max_autotune"] is True
    assert cfg["epilogue_fusion"] is False
    default = C.CompileOptions().inductor_config()
    marked = default.pop("unsafe_marked_cacheable_functions")
    assert default == {"triton.cudagraphs": False}
    assert set(C.CACHEABLE_FUNCTIONS) <= set(marked)


def test_module_under_torch_compile_is_compiled_by_the_pack():
    lin = nn.Linear(4, 4)
    wrapped = torch.compile(lin, backend="inductor", mode="reduce-overhead")
    assert C.unwrap_compiled(wrapped) == (lin, True)
    assert C.unwrap_compiled(lin) == (lin, False)
    assert C.CompiledModule(wrapped, "UNet").target is lin
    # ComfyUI's TorchCompileModel keeps its settings in model_options["torch_compile_kwargs"]
    opts, notes = C.options_from_torch_compile(
        {
            "backend": "cudagraphs",
            "options": None,
            "mode": None,
            "fullgraph": False,
            "dynamic": None,
        }
    )
    assert opts == C.CompileOptions() and "cudagraphs" in notes[0]
    opts, notes = C.options_from_torch_compile(
        {
            "backend": "inductor",
            "mode": "max-autotune",
            "dynamic": True,
            "fullgraph": True,
            "options": {"triton.cudagraphs": True, "epilogue_fusion": False},
        }
    )
    assert opts.mode == "max-autotune-no-cudagraphs" and opts.dynamic == "dynamic"
    assert opts.fullgraph and opts.inductor_options == (("epilogue_fusion", False),)
    assert len(notes) == 2
    assert C.options_from_torch_compile(None)[0] == C.CompileOptions()


def test_cache_dir_default_and_override(monkeypatch, tmp_path):
    monkeypatch.delenv(C.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform not in ("win32", "darwin"):
        assert C.compile_cache_dir() == tmp_path / "xdg" / C.PACK_DIR / "inductor"
    assert C.compile_cache_dir().parts[-2:] == (C.PACK_DIR, "inductor")
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "mine"))
    assert C.compile_cache_dir() == tmp_path / "mine"


def test_persistent_cache_sets_torch_folder_but_keeps_a_users_choice(monkeypatch, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv(C.TORCH_CACHE_ENV, "placeholder")  # restored after the test
    monkeypatch.delenv(C.TORCH_CACHE_ENV)
    ours = tmp_path / "ours"
    got = C.enable_persistent_cache(ours)
    assert got.source == "pack" and got.path == ours and ours.is_dir()
    assert os.environ[C.TORCH_CACHE_ENV] == str(ours)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(ours)  # what inductor itself will use
    # torch filling the variable with its own default is not a user's choice
    monkeypatch.setenv(C.TORCH_CACHE_ENV, default_cache_dir())
    assert C.enable_persistent_cache(ours).source == "pack"
    # a user's folder is kept, whatever the pack would choose
    user = tmp_path / "user"
    monkeypatch.setenv(C.TORCH_CACHE_ENV, str(user))
    got = C.enable_persistent_cache(ours)
    assert got.source == C.TORCH_CACHE_ENV and got.path == user
    assert os.environ[C.TORCH_CACHE_ENV] == str(user)


# -- CUDA: compiled code inside the pack's CUDA graphs --------------------------------------------


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    """A cache folder for one test; the variable the pack sets is removed afterwards."""
    monkeypatch.setenv(C.TORCH_CACHE_ENV, "unset")
    monkeypatch.delenv(C.TORCH_CACHE_ENV)
    return str(tmp_path)


def _skip_unless_compiled_code_can_be_captured():
    """Compiled code is captured under PyTorch's native allocator only: under cudaMallocAsync
    inductor's launcher rejects the not-yet-mapped memory allocated inside a capture, and a
    failed capture leaves that allocator unable to capture again in the process. Compiled mode
    refuses that allocator up front (tests/host/test_compiled_mode.py checks the refusal)."""
    if not CUDA:
        pytest.skip("no CUDA device")
    if torch.cuda.get_allocator_backend() == "cudaMallocAsync":
        pytest.skip("compiled mode refuses the cudaMallocAsync allocator")


def _cuda_unet(dtype=torch.float16):
    torch.manual_seed(0)
    return TinyUNet().eval().requires_grad_(False).to("cuda", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_cuda_compiled_unet_captured_in_graph_replays_like_eager(dtype, own_cache):
    _skip_unless_compiled_code_can_be_captured()
    module = _cuda_unet(dtype)
    cm = C.CompiledModule(module, "UNet", C.CompileOptions(cache_dir=own_cache))
    cache = GraphCache("compiled", backend="cuda")
    # fp32 convolutions run in TF32 on the GPU by default (torch.backends.cudnn.allow_tf32), and
    # eager and compiled code pick different algorithms and layouts for them: measured 4e-4
    # relative on the H200, so 2e-3 there; PARITY_TOL otherwise.
    tol = 2e-3 if dtype == torch.float32 and torch.backends.cudnn.allow_tf32 else None

    def step(x, t, context, c0, c1, strength):
        return cm(x, t, context, [c0, c1], strength)

    def flat(inputs):
        x, t, context, control, strength = inputs
        return [x, t, context, control[0], control[1], strength]

    with torch.inference_mode():
        first = flat(unet_inputs(seed=0, device="cuda", dtype=dtype))
        step(*first)  # compile outside the capture
        assert cm.compiles == 1
        for seed in range(1, 5):
            inputs = flat(unet_inputs(seed=seed, device="cuda", dtype=dtype))
            got = cache.run("k", step, inputs)
            want = module(*inputs[:3], inputs[3:5], inputs[5])
            p = C.check_parity(lambda *a, g=got: g, lambda *a, w=want: w, (), tol=tol)
            assert p.ok, (seed, p.reason)
    assert cache.captures == 1 and cache.lookup("k").replays == 3 and not cache.failed
    assert cm.compiles == 1 and cm.recompiles == 0 and not cm.failed


@pytest.mark.cuda
def test_cuda_signature_not_compiled_before_capture_fails_the_capture_not_the_step(caplog):
    _skip_unless_compiled_code_can_be_captured()
    module = _cuda_unet()
    cm = C.CompiledModule(module, "UNet", C.CompileOptions(backend="eager"))
    cache = GraphCache("compiled", backend="cuda")

    def step(x, t, context, c0, c1, strength):
        return cm(x, t, context, [c0, c1], strength)

    with caplog.at_level(logging.WARNING, logger=LOGGER), torch.inference_mode():
        x, t, context, control, strength = unet_inputs(device="cuda", dtype=torch.float16)
        inputs = [x, t, context, *control, strength]
        got = cache.run("k", step, inputs)  # warm-up runs under sync checks: no compile
        torch.testing.assert_close(got, module(x, t, context, control, strength))
    assert "k" in cache.failed and "CompileNotReady" in cache.failed["k"]
    assert cm.compiles == 1  # the eager rerun outside the capture compiled it


@pytest.mark.cuda
def test_cuda_module_from_torch_compile_is_captured(own_cache):
    _skip_unless_compiled_code_can_be_captured()
    module = _cuda_unet()
    wrapped = torch.compile(module)  # as ComfyUI's TorchCompileModel leaves it
    opts, _ = C.options_from_torch_compile(
        {"backend": "inductor", "mode": None, "dynamic": None, "fullgraph": False},
        C.CompileOptions(cache_dir=own_cache),
    )
    cm = C.CompiledModule(wrapped, "UNet", opts)
    assert cm.target is module
    cache = GraphCache("compiled", backend="cuda")

    def step(x, t, context, c0, c1, strength):
        return cm(x, t, context, [c0, c1], strength)

    with torch.inference_mode():
        x, t, context, control, strength = unet_inputs(device="cuda", dtype=torch.float16)
        inputs = [x, t, context, *control, strength]
        step(*inputs)
        cache.run("k", step, inputs)
        got = cache.run("k", step, inputs)
        want = module(x, t, context, control, strength)
    assert cache.captures == 1 and not cache.failed
    assert C.check_parity(lambda: got, lambda: want, ()).ok


class _Block(nn.Module):
    """Waits (an untraced call, as a residual dict's join does) between two halves."""

    def forward(self, x, d):
        y = x.sin()
        _WAIT(d)
        return y.cos() + d["r"]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x, d):
        return self.block(x * 2, d) + 1


def _no_wait(d):
    return None


_WAIT = C.untraced(_no_wait)


@pytest.mark.parametrize("nested", [False, True], ids=["enclosing-retraced", "nested-breaks"])
def test_many_sizes_with_a_break_in_a_nested_frame_all_compile_whole(nested):
    # A graph break inside a function dynamo inlined leaves compiled code on that function's own
    # code object (a ComfyUI method, shared by every signature and model), or on its resume
    # function, and dropping a signature does not free it. Past dynamo's per-code recompile
    # limit (8) those frames would run eager from then on; the pack's compiles must not hit it.
    if nested and not C.nested_breaks_available():
        pytest.skip("this torch has no nested_graph_breaks")
    torch._dynamo.reset()
    net = _Net()
    opts = C.CompileOptions(backend="eager", nested_breaks=nested)
    cm = C.CompiledModule(net, "UNet", opts, max_shapes=2)
    made = []
    for n in range(2, 14):
        x, r = torch.randn(n), torch.randn(n)
        before = cm.graphs
        out = cm(x, {"r": r})
        made.append(cm.graphs - before)
        torch.testing.assert_close(out, (x * 2).sin().cos() + r + 1)
    assert not cm.failed, cm.failed
    assert cm.compiles == 12 and len(cm.entries) == 2
    assert min(made) >= 2 and len(set(made)) == 1, made  # every size: the graphs around the wait


def test_without_nested_breaks_in_torch_one_line_says_so_and_it_still_compiles(monkeypatch, caplog):
    monkeypatch.setattr(C, "nested_breaks_available", lambda: False)
    torch._dynamo.reset()
    net = _Net()  # held weakly by the compiled module
    opts = C.CompileOptions(backend="eager", nested_breaks=True)
    cm = C.CompiledModule(net, "UNet", opts)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for n in (3, 4):  # two signatures, two traces: said once
            x, r = torch.randn(n), torch.randn(n)
            torch.testing.assert_close(cm(x, {"r": r}), (x * 2).sin().cos() + r + 1)
    assert not cm.failed and cm.compiles == 2
    said = [r.getMessage() for r in caplog.records if "nested_graph_breaks" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("UNet: this torch cannot resume"), said
