# SPDX-License-Identifier: GPL-3.0-or-later
"""Kernel microbenchmark: each CUDA op of ``kernels/`` against the PyTorch path it replaces, at
SD1.5 (512², CFG batch 2) and SDXL (1024², CFG batch 2) shapes, fp16.

Two times per case, both medians over ``reps`` repeats:
- ``graph_us``: GPU time. ``inner`` calls captured in one CUDA graph, replayed, timed with CUDA
  events, divided by ``inner``. What the op costs inside the CUDA Graph Sampler.
- ``eager_us``: the same ``inner`` calls launched from Python back to back, timed the same way:
  the cost outside graphs, where host launch overhead counts too.
Bandwidth is the op's minimum traffic (each input read once, each output written once) over the
GPU time, as a fraction of the device copy rate measured in the same run (a 1 GiB
``copy_``; docs/benchmarks.md: about 4.2 TB/s on the H200).
Each case is also checked against the PyTorch path (relative L2 error) before it is timed.

    python benchmark.py --kernels --out DIR
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

# The residual slots of a ControlNet (13 for SD1.5 at 512², 10 for SDXL at 1024²; CFG batch 2).
# Shared with the kernel and feature-cache tests.
SD15_SLOTS = [(2, 320, 64, 64)] * 3 + [
    (2, 320, 32, 32),
    (2, 640, 32, 32),
    (2, 640, 32, 32),
    (2, 640, 16, 16),
    (2, 1280, 16, 16),
    (2, 1280, 16, 16),
    (2, 1280, 8, 8),
    (2, 1280, 8, 8),
    (2, 1280, 8, 8),
    (2, 1280, 8, 8),
]
SDXL_SLOTS = [(2, 320, 128, 128)] * 3 + [
    (2, 320, 64, 64),
    (2, 640, 64, 64),
    (2, 640, 64, 64),
    (2, 640, 32, 32),
    (2, 1280, 32, 32),
    (2, 1280, 32, 32),
    (2, 1280, 32, 32),
]
# The GroupNorm inputs of the ResBlocks (in_layers and out_layers see the same shapes).
SD15_GN = [(2, 320, 64, 64), (2, 640, 32, 32), (2, 1280, 16, 16), (2, 1280, 8, 8)]
SDXL_GN = [(2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (2, 2560, 32, 32)]
# The Linear layers' matrix multiplies (tokens M with CFG batch 2, outputs N, inputs K) of the
# transformer blocks: self-attention q/k/v/out and proj_in/out (C×C), GEGLU (C -> 8C) and the
# feed-forward's output (4C -> C) at each level, and cross-attention's k/v on the text context
# (77 tokens, twice).
SD15_LINEAR = [
    (8192, 320, 320), (8192, 2560, 320), (8192, 320, 1280),
    (2048, 640, 640), (2048, 5120, 640), (2048, 640, 2560),
    (512, 1280, 1280), (512, 10240, 1280), (512, 1280, 5120),
    (154, 320, 768), (154, 1280, 768),
]  # fmt: skip
SDXL_LINEAR = [
    (8192, 640, 640), (8192, 5120, 640), (8192, 640, 2560),
    (2048, 1280, 1280), (2048, 10240, 1280), (2048, 1280, 5120),
    (154, 640, 2048), (154, 1280, 2048),
]  # fmt: skip


def _nbytes(ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _time(fn: Callable[[], object], inner: int, reps: int, graph: bool) -> float:
    """Median microseconds per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(inner):
                fn()
        g.replay()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if g is not None:
            g.replay()
        else:
            for _ in range(inner):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / inner)
    del g
    return statistics.median(times)


def copy_rate() -> float:
    """Device copy rate in bytes/s (read + write of a 1 GiB buffer)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _time(lambda d=dst, s=src: d.copy_(s), inner=5, reps=7, graph=False)
    del src, dst
    return 2 * (1 << 30) / (us * 1e-6)


def _rel(got, ref) -> float:
    got = got if isinstance(got, list | tuple) else [got]
    ref = ref if isinstance(ref, list | tuple) else [ref]
    num = sum(float((g.double() - r.double()).norm()) ** 2 for g, r in zip(got, ref, strict=True))
    den = sum(float(r.double().norm()) ** 2 for r in ref) or 1.0
    return (num / den) ** 0.5


def _stock_merge(nets, strengths_f):
    """Stock ComfyUI's ControlNet.control_merge for a chain: each net's residuals scaled in
    place (``x *= strength``), then ``o[i] = prev_val + o[i]`` down the chain."""
    out = None
    for net, s in zip(nets, strengths_f, strict=True):
        cur = []
        for x in net:
            x.mul_(s)
            cur.append(x)
        out = cur if out is None else [p + o for p, o in zip(out, cur, strict=True)]
    return out


def _inductor(fn, backend="inductor"):
    """``fn`` compiled by inductor as compiled mode compiles (static shapes): each new shape
    compiles code of its own. Left to torch's default, the second shape a compiled function
    meets recompiles it with dynamic shapes, and from then on every shape runs code that is not
    specialised to it, slower than what compiled mode runs. The cases call one function with up
    to 19 shapes, over dynamo's default of 8 compiles per function; past it, calls would run
    eager."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False, backend=backend)


def cases(kernels, reps: int, dev: str = "cuda", only: str | None = None, tiles=None):
    """Yield result dicts (``only``: the ops whose name starts with it; ``tiles``: int8_linear
    tile shapes to time besides the default one)."""
    if only == "int8_linear":
        yield from _int8_linear_cases(kernels, reps, dev, tiles)
        return
    if only == "fp8_linear":
        yield from _fp8_linear_cases(reps, dev)
        return
    if only == "geglu_linear":
        yield from _geglu_linear_cases(reps, dev)
        return

    dt_ = torch.float16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(shape, dtype=dt_):
        return torch.randn(shape, generator=g, device=dev, dtype=torch.float32).to(dtype)

    # a. control merge, 1 and 2 nets, plain and with the UNet's hidden-state add.
    for arch, slots in (("sd15", SD15_SLOTS), ("sdxl", SDXL_SLOTS)):
        for n in (1, 2):
            nets = [[rnd(s) for s in slots] for _ in range(n)]
            strengths_f = [0.8, 0.55][:n]
            sdev = torch.tensor(strengths_f, device=dev, dtype=torch.float32)
            # Stock scales in place; work on copies so repeats do not drift to inf/0.
            work = [[x.clone() for x in net] for net in nets]
            ref = [
                sum(strengths_f[i] * nets[i][k].float() for i in range(n))
                for k in range(len(slots))
            ]
            got = kernels.control_merge(nets, sdev)
            err = _rel(got, [r.to(dt_) for r in ref])
            traffic = _nbytes([x for net in nets for x in net]) + _nbytes(nets[0])
            stock = lambda w=work, f=strengths_f: _stock_merge(w, f)  # noqa: E731
            fused = lambda r=nets, s=sdev: kernels.control_merge(r, s)  # noqa: E731
            yield _row(
                f"control_merge N={n}",
                arch,
                len(slots),
                traffic,
                err,
                stock,
                fused,
                reps,
                stock_launches=len(slots) * (2 * n - 1),
                fused_launches=1,
            )
            hidden = [rnd(s) for s in slots]

            def stock_add(hidden=hidden, work=work, strengths_f=strengths_f):
                for h, c in zip(hidden, _stock_merge(work, strengths_f), strict=True):
                    h += c

            h2 = [h.clone() for h in hidden]
            kernels.control_merge_add_(h2, nets, sdev)
            ref_add = [h.float() + r for h, r in zip(hidden, ref, strict=True)]
            err = _rel(h2, [r.to(dt_) for r in ref_add])
            traffic_add = traffic + _nbytes(hidden)
            yield _row(
                f"control_merge_add_ N={n}",
                arch,
                len(slots),
                traffic_add,
                err,
                stock_add,
                lambda h=hidden, nets=nets, s=sdev: kernels.control_merge_add_(h, nets, s),
                reps,
                stock_launches=len(slots) * 2 * n,
                fused_launches=1,
            )
            del nets, work, hidden, h2

    # b. INT8 quantize per (sample, channel) and dequantize-scale-add, over all slots.
    for arch, slots in (("sd15", SD15_SLOTS), ("sdxl", SDXL_SLOTS)):
        xs = [rnd(s) for s in slots]

        def torch_quant(xs=xs):
            out = []
            for x in xs:
                b, c = x.shape[:2]
                amax = x.reshape(b, c, -1).abs().amax(-1).float()
                scale = amax / 127.0
                inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
                q = torch.round(x.float() * inv[:, :, None, None]).clamp_(-127, 127).to(torch.int8)
                out.append((q, scale))
            return out

        got = [kernels.quantize_int8(x) for x in xs]
        ref = torch_quant()
        err = max(
            float((gq.int() - rq.int()).abs().max())
            for (gq, _), (rq, _) in zip(got, ref, strict=True)
        )
        traffic = _nbytes(xs) + sum(x.numel() for x in xs)
        yield _row(
            "quantize_int8",
            arch,
            len(slots),
            traffic,
            err,
            torch_quant,
            lambda xs=xs: [kernels.quantize_int8(x) for x in xs],
            reps,
            err_kind="max |q diff|",
        )
        hidden = [rnd(s) for s in slots]
        qs = got
        st = torch.tensor(0.7, device=dev)

        def torch_deq(hidden=hidden, qs=qs):
            for h, (q, sc) in zip(hidden, qs, strict=True):
                h += (0.7 * sc)[:, :, None, None].to(h.dtype) * q.to(h.dtype)

        h2 = [h.clone() for h in hidden]
        for h, (q, sc) in zip(h2, qs, strict=True):
            kernels.dequant_add_(h, q, sc, st)
        ref = [
            h.float() + 0.7 * sc[:, :, None, None] * q.float()
            for h, (q, sc) in zip(hidden, qs, strict=True)
        ]
        err = _rel(h2, [r.to(dt_) for r in ref])
        traffic = 2 * _nbytes(hidden) + sum(h.numel() for h in hidden)

        def cna_deq(hidden=hidden, qs=qs, st=st):
            for h, (q, sc) in zip(hidden, qs, strict=True):
                kernels.dequant_add_(h, q, sc, st)

        yield _row("dequant_add_", arch, len(slots), traffic, err, torch_deq, cna_deq, reps)
        del xs, hidden, h2, qs

    # b2. INT8 weight rows expanded to fp16 for one layer call (the Memory Pool's weights):
    # the largest SD1.5 / SDXL conv and linear weights, against PyTorch's cast-and-scale.
    for arch, wshapes in (
        ("sd15", ((1280, 1280, 3, 3), (10240, 1280), (320, 320))),
        ("sdxl", ((1280, 2560, 3, 3), (10240, 1280), (640, 2048))),
    ):
        for wshape in wshapes:
            w = rnd(wshape)
            rows = w.reshape(wshape[0], -1).float()
            scale = (rows.abs().amax(1) / 127.0).clamp_min(1e-12)
            sshape = (wshape[0],) + (1,) * (len(wshape) - 1)
            q = torch.round(w.float() / scale.view(sshape)).clamp_(-127, 127).to(torch.int8)
            scale = scale.view(sshape).contiguous()
            ref = (q.float() * scale).to(dt_)
            err = _rel([kernels.dequant_rows(q, scale, dt_)], [ref])
            traffic = q.numel() * 3 + scale.numel() * 4
            yield _row(
                f"dequant_rows {'x'.join(map(str, wshape))}",
                arch,
                1,
                traffic,
                err,
                lambda q=q, scale=scale: q.to(dt_) * scale.to(dt_),
                lambda q=q, scale=scale: kernels.dequant_rows(q, scale, dt_),
                reps,
            )
            del w, q

    # c. GroupNorm(32) + SiLU, one shape at a time.
    for arch, shapes in (("sd15", SD15_GN), ("sdxl", SDXL_GN)):
        for shape in shapes:
            x = rnd(shape)
            w = (1 + 0.1 * rnd((shape[1],), torch.float32)).to(dt_)
            b = (0.1 * rnd((shape[1],), torch.float32)).to(dt_)
            ref = F.silu(F.group_norm(x.float(), 32, w.float(), b.float(), 1e-5))
            err = _rel(kernels.group_norm_silu(x, w, b, 32, 1e-5), ref.to(dt_))
            traffic = 2 * _nbytes([x])
            yield _row(
                f"group_norm_silu {shape[1]}x{shape[2]}²",
                arch,
                1,
                traffic,
                err,
                lambda x=x, w=w, b=b: F.silu(F.group_norm(x, 32, w, b, 1e-5)),
                lambda x=x, w=w, b=b: kernels.group_norm_silu(x, w, b, 32, 1e-5),
                reps,
            )
            del x

    yield from _int8_linear_cases(kernels, reps, dev, tiles)


_E4M3 = getattr(torch, "float8_e4m3fn", None)


def _fp8_quant(t: torch.Tensor, rowwise: bool):
    """t (R, K) -> (e4m3 values, float32 scale): one scale per row, or one for the tensor."""
    amax = t.float().abs().amax(dim=1, keepdim=True) if rowwise else t.float().abs().amax()
    scale = amax.clamp(min=1e-12) / torch.finfo(_E4M3).max
    return (t.float() / scale).to(_E4M3), scale


def _fp8_linear(x, w8t, sw, b, rowwise: bool):
    """F.linear with the activation quantized at run time (per token, or per tensor) and the
    weight already e4m3 (per output channel, or per tensor), fp16 out."""
    x8, sx = _fp8_quant(x, rowwise)
    return torch._scaled_mm(x8, w8t, scale_a=sx, scale_b=sw, bias=b, out_dtype=x.dtype)


def _fp8_linear_cases(reps, dev):
    # f. FP8 (e4m3) matrix multiplies for an FP8 mode, against fp16 F.linear, each compiled by
    # inductor so that quantizing the activation fuses as it would in compiled mode. Row-wise:
    # a scale per token and per output channel; tensor-wise: one each. err: relative L2 against
    # an fp64 product of the fp16 operands (fp16 alone: its rounding).
    if _E4M3 is None or not hasattr(torch, "_scaled_mm"):
        return
    dt_ = torch.float16
    g = torch.Generator(device=dev).manual_seed(3)
    f16 = _inductor(lambda x, w, b: F.linear(x, w, b))
    rows = _inductor(lambda x, w8t, sw, b: _fp8_linear(x, w8t, sw, b, True))
    tens = _inductor(lambda x, w8t, sw, b: _fp8_linear(x, w8t, sw, b, False))
    for arch, shapes in (("sd15", SD15_LINEAR), ("sdxl", SDXL_LINEAR)):
        for m, n, k in shapes:
            if m % 16 or n % 16 or k % 16:
                continue  # _scaled_mm's alignment
            x = torch.randn(m, k, generator=g, device=dev).to(dt_)
            w = (torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(dt_)
            b = torch.randn(n, generator=g, device=dev).to(dt_) * 0.1
            ref = F.linear(x.double(), w.double(), b.double())
            w8r, swr = _fp8_quant(w, True)
            w8t, swt = _fp8_quant(w, False)
            args_r = (x, w8r.t(), swr.t().contiguous(), b)
            args_t = (x, w8t.t(), swt, b)
            extra = {
                "flops": 2 * m * n * k,
                "fp16_err": _rel(f16(x, w, b), ref),
                "rowwise_err": _rel(rows(*args_r), ref),
                "tensorwise_err": _rel(tens(*args_t), ref),
                "tensorwise_graph_us": _time(lambda a=args_t: tens(*a), 20, reps, True),
            }
            yield _row(
                f"fp8_linear {m}x{n}x{k} rowwise",
                arch,
                1,
                m * k * 2 + n * k + m * n * 2,
                extra["rowwise_err"],
                lambda x=x, w=w, b=b: f16(x, w, b),
                lambda a=args_r: rows(*a),
                reps,
                **extra,
            )
            del x, w


# The feed-forward projections (tokens, 2 × inner width, model width) of SD1.5 at 512² and
# 1024² and of SDXL at 1024², batch 2 (CFG).
SD15_GEGLU = [(8192, 2560, 320), (2048, 5120, 640), (512, 10240, 1280), (32768, 2560, 320)]
SDXL_GEGLU = [(8192, 5120, 640), (2048, 10240, 1280)]
# Tile shapes (tokens, outputs per half, depth, warps, stages[, group, tensor memory
# accelerator]) the geglu_linear cases also time.
GEGLU_TILES = [
    (128, 64, 64, 8, 3), (128, 64, 64, 4, 4), (128, 64, 32, 4, 4), (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (256, 64, 64, 8, 3), (64, 64, 64, 4, 4),
    (128, 128, 64, 8, 3, 8, True), (128, 128, 64, 8, 4, 8, True), (128, 128, 32, 8, 5, 8, True),
    (128, 64, 64, 4, 3, 8, True), (128, 64, 64, 8, 4, 8, True), (64, 128, 64, 4, 4, 8, True),
]  # fmt: skip


def _geglu_linear_cases(reps, dev):
    # g. The feed-forward projection with its GEGLU in the GEMM's epilogue, against the path
    # compiled mode runs now: inductor's code for F.linear + chunk + value * gelu(gate)
    # (cuBLAS's GEMM, then one fused elementwise kernel). err: relative L2 against fp64.
    from ..kernels import geglu_linear as gl

    dt_ = torch.float16
    g = torch.Generator(device=dev).manual_seed(4)
    plain = _inductor(gl.reference)
    for arch, shapes in (("sd15", SD15_GEGLU), ("sdxl", SDXL_GEGLU)):
        for m, n2, k in shapes:
            x = torch.randn(m, k, generator=g, device=dev).to(dt_)
            w = (torch.randn(n2, k, generator=g, device=dev) * k**-0.5).to(dt_)
            b = torch.randn(n2, generator=g, device=dev).to(dt_) * 0.1
            ref = gl.reference(x.double(), w.double(), b.double())
            why = gl.problem(x, w, b)
            if why is not None:
                print(f"geglu_linear {m}x{n2}x{k}: {why}")
                continue
            tiles_us = {}
            for t in GEGLU_TILES:
                cfg = gl.Config(*t)
                try:
                    tiles_us[str(t)] = _time(
                        lambda x=x, w=w, b=b, c=cfg: gl.geglu_linear(x, w, b, c), 20, reps, True
                    )
                except Exception as e:  # a tile too large for this GPU's shared memory
                    tiles_us[str(t)] = float("nan")
                    print(f"  tile {t}: {type(e).__name__}: {str(e)[:120]}")
            extra = {
                "flops": 2 * m * n2 * k,
                "plain_err": _rel(plain(x, w, b), ref),
                "tile": str(tuple(gl.default_config(m, n2 // 2, k))),
                "tiles_graph_us": tiles_us,
                "plain_eager_graph_us": _time(
                    lambda x=x, w=w, b=b: gl.reference(x, w, b), 20, reps, True
                ),
                # the projection alone (cuBLAS), without the GEGLU: what a fused kernel's
                # matrix multiply must match for the GEGLU's pass to be all it saves
                "gemm_only_graph_us": _time(
                    lambda x=x, w=w, b=b: F.linear(x, w, b), 20, reps, True
                ),
            }
            # Cold weights: each call in the graph reads another copy of the weight (120 MB of
            # copies in all, over twice an H100's or H200's L2), as each block of a step reads
            # its own weight; above, all calls read one weight that stays in L2.
            copies = max(2, -(-120_000_000 // (n2 * k * 2)))
            ws = [w.clone() for _ in range(copies)]
            bs = [b.clone() for _ in range(copies)]
            for name, fn in (("cold_plain_graph_us", plain), ("cold_kernel_graph_us", None)):
                fn = fn or gl.geglu_linear
                turn = iter(range(10**9))

                def call(fn=fn, x=x, turn=turn, ws=ws, bs=bs, copies=copies):
                    j = next(turn) % copies
                    return fn(x, ws[j], bs[j])

                extra[name] = _time(call, 20, reps, True)
            del ws, bs
            yield _row(
                f"geglu_linear {m}x{n2}x{k} vs inductor",
                arch,
                1,
                m * k * 2 + n2 * k * 2 + m * n2,
                _rel(gl.geglu_linear(x, w, b), ref),
                lambda x=x, w=w, b=b: plain(x, w, b),
                lambda x=x, w=w, b=b: gl.geglu_linear(x, w, b),
                reps,
                **extra,
            )
            del x, w


def _int8_linear_cases(kernels, reps, dev, tiles):
    # d. The Memory Pool's INT8 Linear: one matrix multiply reading the INT8 weight, against
    # the path it replaces (the weight expanded to fp16, then PyTorch's F.linear), with stock's
    # F.linear on the fp16 weight alongside (``fp16_graph_us``).
    from ..kernels import int8_matmul

    dt_ = torch.float16
    g = torch.Generator(device=dev).manual_seed(1)
    for arch, shapes in (("sd15", SD15_LINEAR), ("sdxl", SDXL_LINEAR)):
        for m, n, k in shapes:
            x = torch.randn(m, k, generator=g, device=dev).to(dt_)
            w = (torch.randn(n, k, generator=g, device=dev) * k**-0.5).to(dt_)
            b = torch.randn(n, generator=g, device=dev).to(dt_) * 0.1
            scale = (w.float().abs().amax(1) / 127.0).clamp_min(1e-12)
            q = torch.round(w.float() / scale[:, None]).clamp_(-127, 127).to(torch.int8)
            ref = F.linear(x.float(), q.float() * scale[:, None], b.float())
            err = _rel(kernels.int8_linear(x, q, scale, b), ref.to(dt_))
            expand = lambda x=x, q=q, s=scale, b=b: F.linear(  # noqa: E731
                x, kernels.dequant_rows(q, s, dt_), b
            )
            fused = lambda x=x, q=q, s=scale, b=b: kernels.int8_linear(x, q, s, b)  # noqa: E731
            extra = {
                "fp16_graph_us": _time(lambda x=x, w=w, b=b: F.linear(x, w, b), 20, reps, True),
                "flops": 2 * m * n * k,
                "tile": list(int8_matmul.default_config(m, n, k)),
            }
            if tiles:
                extra["tiles_graph_us"] = {
                    ",".join(map(str, t)): _time(
                        lambda x=x, q=q, s=scale, b=b, t=t: int8_matmul.linear(x, q, s, b, t),
                        20,
                        reps,
                        True,
                    )
                    for t in tiles
                }
            traffic = m * k * 2 + n * k + m * n * 2
            yield _row(
                f"int8_linear {m}x{n}x{k}", arch, 1, traffic, err, expand, fused, reps, **extra
            )
            del x, w, q


def _row(op, arch, tensors, traffic, err, torch_fn, cna_fn, reps, err_kind="rel L2", **extra):
    inner = 20
    t_g = _time(torch_fn, inner, reps, graph=True)
    c_g = _time(cna_fn, inner, reps, graph=True)
    t_e = _time(torch_fn, inner, reps, graph=False)
    c_e = _time(cna_fn, inner, reps, graph=False)
    return {
        "op": op,
        "arch": arch,
        "tensors": tensors,
        "traffic_mb": traffic / 1e6,
        "err": err,
        "err_kind": err_kind,
        "torch_graph_us": t_g,
        "cna_graph_us": c_g,
        "torch_eager_us": t_e,
        "cna_eager_us": c_e,
        "speedup_graph": t_g / c_g,
        "speedup_eager": t_e / c_e,
        "cna_bytes_per_s": traffic / (c_g * 1e-6),
        **extra,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="benchmark.py --kernels",
        description="Kernel microbenchmark: each CUDA op of kernels/ against the PyTorch path it "
        "replaces, at SD1.5 and SDXL shapes, fp16 (GPU only).",
    )
    ap.add_argument(
        "--out", default=None, help="folder for kernels.json and kernels.md (default: print only)"
    )
    ap.add_argument("--reps", type=int, default=15, help="timed repeats per case (default 15)")
    ap.add_argument(
        "--only",
        choices=["int8_linear", "fp8_linear", "geglu_linear"],
        default=None,
        help="run only these cases (fp8_linear: e4m3 matrix multiplies, row-wise and "
        "tensor-wise scales, against fp16, for an FP8 mode; geglu_linear: the feed-forward "
        "projection with GEGLU in its epilogue, against inductor's GEMM + GEGLU; these two "
        "only with this option)",
    )
    ap.add_argument(
        "--int8-tiles",
        action="store_true",
        help="also time int8_linear at each tile shape of a fixed sweep (tiles_graph_us)",
    )
    return ap


# Tile shapes (weight rows, tokens, depth, warps, stages) the --int8-tiles sweep times.
INT8_TILES = [
    (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
    (128, 128, 128, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 128, 4, 4),
    (128, 32, 128, 4, 4), (64, 32, 128, 4, 4), (64, 16, 256, 4, 3), (128, 16, 128, 4, 4),
]  # fmt: skip


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA GPU")
        return 2
    from .. import kernels
    from ..kernels import registry

    torch.backends.cudnn.benchmark = False
    with registry.use_backend("cuda"):
        rate = copy_rate()
        rows = []
        tiles = None
        if a.int8_tiles:
            from ..kernels.int8_matmul import Config

            tiles = [Config(*t) for t in INT8_TILES]
        for r in cases(kernels, a.reps, only=a.only, tiles=tiles):
            r["frac_copy_rate"] = r["cna_bytes_per_s"] / rate
            rows.append(r)
            print(
                f"{r['arch']:5s} {r['op']:32s} err {r['err']:.2e}  "
                f"graph {r['torch_graph_us']:8.1f} "
                f"-> {r['cna_graph_us']:8.1f} us ({r['speedup_graph']:.2f}x)  eager "
                f"{r['torch_eager_us']:8.1f} -> {r['cna_eager_us']:8.1f} us "
                f"({r['speedup_eager']:.2f}x)  {r['frac_copy_rate'] * 100:5.1f}% of copy",
                flush=True,
            )
            if "tensorwise_graph_us" in r:
                print(
                    f"      tensor-wise {r['tensorwise_graph_us']:8.1f} us; err fp16 "
                    f"{r['fp16_err']:.1e} row-wise {r['rowwise_err']:.1e} tensor-wise "
                    f"{r['tensorwise_err']:.1e}",
                    flush=True,
                )
            if "plain_err" in r:
                tiles_us = r["tiles_graph_us"]
                best = min(tiles_us.items(), key=lambda kv: kv[1], default=("-", float("nan")))
                print(
                    f"      plain err {r['plain_err']:.1e}; eager plain "
                    f"{r['plain_eager_graph_us']:.1f} us; tile {r['tile']}; best tile {best[0]} "
                    f"{best[1]:.1f} us; all "
                    + " ".join(f"{v:.1f}" for v in tiles_us.values())
                    + f"; cold weights: inductor {r['cold_plain_graph_us']:.1f} us, kernel "
                    f"{r['cold_kernel_graph_us']:.1f} us",
                    flush=True,
                )
            if "fp16_graph_us" in r:
                tiles_us = r.get("tiles_graph_us") or {}
                best = min(tiles_us.items(), key=lambda kv: kv[1], default=("-", float("nan")))
                print(
                    f"      fp16 weight (stock) {r['fp16_graph_us']:8.1f} us; tile {r['tile']}; "
                    f"best swept tile {best[0]} {best[1]:.1f} us",
                    flush=True,
                )
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "copy_rate_tb_s": rate / 1e12,
        "dtype": "float16",
        "reps": a.reps,
    }
    print(f"device copy rate {rate / 1e12:.2f} TB/s")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
        # The baseline is the PyTorch path the kernel replaces: eager PyTorch, or inductor's
        # code where the op's name says "vs inductor".
        lines = [
            "| arch | op | tensors | MB | err | baseline graph µs | CNA graph µs | × | "
            "baseline eager µs | CNA eager µs | × | % copy rate |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['arch']} | {r['op']} | {r['tensors']} | {r['traffic_mb']:.1f} | "
                f"{r['err']:.1e} | {r['torch_graph_us']:.1f} | {r['cna_graph_us']:.1f} | "
                f"{r['speedup_graph']:.2f} | {r['torch_eager_us']:.1f} | {r['cna_eager_us']:.1f} | "
                f"{r['speedup_eager']:.2f} | {r['frac_copy_rate'] * 100:.0f}% |"
            )
        (out / "kernels.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
