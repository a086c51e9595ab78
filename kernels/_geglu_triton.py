# SPDX-License-Identifier: GPL-3.0-or-later
"""The Triton kernel of ``geglu_linear.py`` (imported on first use: Triton is needed only where
the kernel runs)."""

import triton
import triton.language as tl


@triton.jit
def geglu_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    sxm, sxk, swn, swk, sym, syn,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    grid_m = (M + BM - 1) // BM  # not tl.cdiv: the tests run this code in the interpreter
    grid_n = (N + BN - 1) // BN
    # Programs in groups of GROUP token tiles walk the output tiles together, so a weight
    # tile is read from L2 while GROUP token tiles use it.
    width = GROUP * grid_n
    first_m = (pid // width) * GROUP
    size_m = min(grid_m - first_m, GROUP)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    # Out-of-range tokens and outputs read a valid row instead (no mask in the loop) and
    # are never stored.
    rm = tl.max_contiguous(tl.multiple_of(offs_m % M, BM), BM)
    rn = tl.max_contiguous(tl.multiple_of(offs_n % N, BN), BN)
    x_ptrs = x_ptr + rm[:, None] * sxm + offs_k[None, :] * sxk
    v_ptrs = w_ptr + rn[None, :] * swn + offs_k[:, None] * swk  # value rows, (BK, BN)
    g_ptrs = v_ptrs + N * swn  # the gate rows: the weight's second half

    acc_v = tl.full((BM, BN), 0.0, tl.float32)  # not tl.zeros: see grid_m
    acc_g = tl.full((BM, BN), 0.0, tl.float32)
    for k in range(0, (K + BK - 1) // BK):
        if EVEN_K:
            a = tl.load(x_ptrs)
            wv = tl.load(v_ptrs)
            wg = tl.load(g_ptrs)
        else:
            left = K - k * BK
            a = tl.load(x_ptrs, mask=offs_k[None, :] < left, other=0.0)
            wv = tl.load(v_ptrs, mask=offs_k[:, None] < left, other=0.0)
            wg = tl.load(g_ptrs, mask=offs_k[:, None] < left, other=0.0)
        acc_v = tl.dot(a, wv, acc_v)
        acc_g = tl.dot(a, wg, acc_g)
        x_ptrs += BK * sxk
        v_ptrs += BK * swk
        g_ptrs += BK * swk

    if HAS_BIAS:
        acc_v += tl.load(b_ptr + rn).to(tl.float32)[None, :]
        acc_g += tl.load(b_ptr + N + rn).to(tl.float32)[None, :]
    gelu = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476))
    y = (acc_v * gelu).to(y_ptr.dtype.element_ty)
    y_ptrs = y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn
    tl.store(y_ptrs, y, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def geglu_kernel_tma(
    x_desc, w_desc, b_ptr, y_desc,
    M, N, K,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
    PROGRAMS: tl.constexpr,
):  # fmt: skip
    """The same product as ``geglu_kernel``, with the tiles moved by the GPU's tensor memory
    accelerator (Hopper and later; host-built descriptors: x (M, K) in [BM, BK] blocks, w (2N, K)
    in [BN, BK], y (M, N) in [BM, BN]), and a fixed number of programs, each taking every
    PROGRAMS-th output tile, so one tile's epilogue overlaps the next one's loads. Blocks past
    an edge read zeros and are not stored."""
    pid = tl.program_id(0)
    grid_m = (M + BM - 1) // BM
    grid_n = (N + BN - 1) // BN
    tiles = grid_m * grid_n
    k_tiles = (K + BK - 1) // BK
    width = GROUP * grid_n
    for t in tl.range(pid, tiles, PROGRAMS, flatten=True):
        first_m = (t // width) * GROUP
        size_m = min(grid_m - first_m, GROUP)
        om = (first_m + (t % width) % size_m) * BM
        on = ((t % width) // size_m) * BN
        acc_v = tl.full((BM, BN), 0.0, tl.float32)
        acc_g = tl.full((BM, BN), 0.0, tl.float32)
        for kk in range(k_tiles):
            a = x_desc.load([om, kk * BK])
            wv = w_desc.load([on, kk * BK])
            wg = w_desc.load([N + on, kk * BK])
            acc_v = tl.dot(a, wv.T, acc_v)
            acc_g = tl.dot(a, wg.T, acc_g)
        if HAS_BIAS:
            rn = on + tl.arange(0, BN)
            acc_v += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(b_ptr + N + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        gelu = 0.5 * acc_g * (1.0 + tl.math.erf(acc_g * 0.7071067811865476))
        y_desc.store([om, on], (acc_v * gelu).to(y_desc.dtype))
