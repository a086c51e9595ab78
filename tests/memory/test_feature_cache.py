# SPDX-License-Identifier: GPL-3.0-or-later
"""The feature cache's storage and reuse rule, without ComfyUI (CPU, eager kernels)."""

from __future__ import annotations

import pytest
import torch
from comfyui_controlnet_accelerator.harness.kernel_bench import SD15_SLOTS, SDXL_SLOTS
from comfyui_controlnet_accelerator.memory.feature_cache import (
    CacheConfig,
    ResidualStore,
    ReusePolicy,
    StorePool,
    input_change,
    step_of,
)


def _out(shapes, seed=0, dtype=torch.float32, scale_range=(0.1, 10.0)):
    g = torch.Generator().manual_seed(seed)
    ts = []
    for s in shapes:
        # per-channel magnitudes spanning two decades, as ControlNet residuals do
        mag = torch.empty(s[0], s[1], 1, 1).uniform_(*scale_range, generator=g)
        ts.append((torch.randn(s, generator=g) * mag).to(dtype))
    return {"output": ts[:-1], "middle": ts[-1:]}


def _flat(out):
    return [t for k in ("input", "middle", "output") for t in out.get(k, [])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int8_round_trip_error_is_within_half_a_step_per_plane(dtype):
    out = _out([(2, 8, 9, 7), (1, 3, 4, 4), (2, 5, 1, 1)], seed=1, dtype=dtype)
    st = ResidualStore("int8")
    st.put(out)
    back = st.get()
    for a, b in zip(_flat(out), _flat(back), strict=True):
        assert b.dtype == a.dtype and b.shape == a.shape
        af, bf = a.float(), b.float()
        step = af.abs().amax(dim=(2, 3), keepdim=True) / 127
        # half a quantization step, plus the output dtype's own rounding of the result
        ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
        assert ((af - bf).abs() <= step / 2 + ulp * af.abs() + 1e-12).all()


def test_fp16_storage_is_exact_and_none_slots_survive():
    out = _out([(1, 4, 3, 3), (1, 4, 2, 2)], seed=2, dtype=torch.float16)
    out["input"] = [None]
    st = ResidualStore("fp16")
    st.put(out)
    back = st.get()
    assert back["input"] == [None]
    for a, b in zip(_flat(out)[1:], _flat(back)[1:], strict=True):
        assert torch.equal(a, b)


def test_buffers_are_reused_in_place_and_a_new_layout_gets_a_new_generation():
    st = ResidualStore("int8")
    st.put(_out([(1, 4, 8, 8)], seed=3))
    gen, ptr = st.generation, st.buffers[0][0].data_ptr()
    st.put(_out([(1, 4, 8, 8)], seed=4))
    assert st.generation == gen and st.buffers[0][0].data_ptr() == ptr
    st.put(_out([(1, 4, 16, 16)], seed=5))
    assert st.generation != gen
    g2 = st.generation
    st.clear()
    assert not st.filled and st.generation != g2 and st.nbytes() == 0


def test_get_returns_fresh_tensors_the_caller_may_scale_in_place():
    st = ResidualStore("int8")
    st.put(_out([(1, 2, 4, 4), (1, 2, 2, 2)], seed=6))
    first = st.get()
    assert set(first) == {"output", "middle"}
    first["middle"][0].mul_(0.0)  # ComfyUI's control_merge does x *= strength
    again = st.get()
    assert again["middle"][0] is not first["middle"][0]
    assert again["middle"][0].abs().sum() > 0


@pytest.mark.parametrize("arch,shapes", [("sd15", SD15_SLOTS), ("sdxl", SDXL_SLOTS)])
def test_int8_store_is_at_most_52_percent_of_fp16(arch, shapes):
    meta = [torch.empty(s, dtype=torch.float16, device="meta") for s in shapes]
    int8 = sum(t.numel() + 4 * t.shape[0] * t.shape[1] for t in meta)
    fp16 = sum(2 * t.numel() for t in meta)
    assert int8 / fp16 <= 0.52, (arch, int8 / fp16)
    # and the store's own count agrees on a real (small-batch) instance
    st8, st16 = ResidualStore("int8"), ResidualStore("fp16")
    small = _out([(1, c, 8, 8) for _, c, _, _ in shapes[:4]], seed=7, dtype=torch.float16)
    st8.put(small)
    st16.put(small)
    n = sum(t.numel() for t in _flat(small))
    planes = sum(t.shape[0] * t.shape[1] for t in _flat(small))
    assert st8.nbytes() == n + 4 * planes and st16.nbytes() == 2 * n


# -- the reuse rule -------------------------------------------------------------------------------


def _walk(cfg, total=10, xs=None, key=("k",)):
    """Decisions over a run where the policy fills on every compute. xs: inputs per step."""
    pol = ReusePolicy(cfg)
    seq = []
    for step in range(total):
        x = xs[step] if xs is not None else torch.ones(4)
        t = 10.0 - step * 0.001
        d = pol.decide(step, total, x, t, key)
        if d.reuse:
            pol.reused_one()
        else:
            pol.filled(step, x, t, key)
        seq.append("R" if d.reuse else "C")
    return "".join(seq), pol


def test_off_never_reuses():
    seq, pol = _walk(CacheConfig(mode="off"))
    assert seq == "C" * 10 and pol.reused == 0
    seq, _ = _walk(CacheConfig(mode="every_n", every_n=2, max_reuse=0))  # max_reuse 0 = off
    assert seq == "C" * 10


def test_every_n_pattern_first_and_last_always_computed():
    assert _walk(CacheConfig(mode="every_n", every_n=2, max_reuse=1))[0] == "CRCRCRCRCC"
    assert _walk(CacheConfig(mode="every_n", every_n=3, max_reuse=2))[0] == "CRRCRRCRRC"
    # max_reuse caps the streak below every_n
    assert _walk(CacheConfig(mode="every_n", every_n=4, max_reuse=1))[0] == "CRCRCRCRCC"


def test_reuse_range_limits_where_reuse_happens():
    cfg = CacheConfig(mode="every_n", every_n=2, max_reuse=1, reuse_start=0.5, reuse_end=0.8)
    seq, _ = _walk(cfg)
    assert seq[:5] == "CCCCC" and "R" in seq[5:8] and seq[-1] == "C"


def test_key_change_forces_compute():
    pol = ReusePolicy(CacheConfig(mode="every_n", every_n=5, max_reuse=4))
    x = torch.ones(3)
    pol.filled(0, x, 10.0, ("hint-a",))
    assert pol.decide(1, 10, x, 9.0, ("hint-a",)).reuse
    assert not pol.decide(1, 10, x, 9.0, ("hint-b",)).reuse
    assert not pol.decide(1, 10, x, 9.0, ((2, 4, 8, 8),)).reuse


def test_adaptive_reuses_small_changes_and_computes_large_ones():
    xs = [torch.full((64,), 1.0)] * 3 + [torch.full((64,), 3.0)] * 3 + [torch.full((64,), 3.1)] * 4
    seq, pol = _walk(CacheConfig(mode="adaptive", threshold=0.1, max_reuse=5), xs=xs)
    assert seq == "CRRCRRRRRC"
    d = pol.decide(5, 10, torch.full((64,), 1.0), 10.0, ("k",))
    assert d.estimate is not None and d.estimate > 0.5 and not d.reuse


def test_adaptive_threshold_zero_never_reuses_a_changing_input():
    xs = [torch.full((8,), 1.0 + i) for i in range(10)]
    seq, _ = _walk(CacheConfig(mode="adaptive", threshold=0.0, max_reuse=5), xs=xs)
    assert seq == "C" * 10


def test_input_change_and_step_of():
    a, b = torch.tensor([1.0, -1.0]), torch.tensor([1.5, -1.0])
    assert float(input_change(b, a)) == pytest.approx(0.25)
    sched = [14.6, 7.0, 3.1, 1.0, 0.0]
    assert step_of(7.0, sched) == (1, 4)
    assert step_of(0.5, sched) is None
    assert step_of(1.0, []) is None


def test_config_rejects_bad_values():
    with pytest.raises(ValueError):
        CacheConfig(mode="sometimes")
    with pytest.raises(ValueError):
        CacheConfig(storage="int4")
    with pytest.raises(ValueError):
        CacheConfig(reuse_start=0.9, reuse_end=0.1)


def test_store_pool_hands_each_store_to_one_user_at_a_time():
    pool = StorePool("int8")
    a, b = pool.take(), pool.take()
    assert a is not b  # two users in one run never share buffers
    a.put({"output": [torch.randn(1, 4, 2, 2)]})
    gen = a.generation
    pool.give(a)
    pool.give(a)  # giving twice does not hand it out twice
    again = pool.take()
    assert again is a and again.generation == gen and again.filled  # same buffers back
    assert pool.take() is not a
    pool.give(a)
    assert pool.nbytes() == a.nbytes() > 0
    pool.clear()
    assert pool.nbytes() == 0 and not a.filled


def test_store_pool_keeps_each_layout_for_its_own_workflow():
    """Two workflows alternating on one network at two sizes: each gets back the buffers (and
    generation) it had, so neither recaptures its graphs; never more than ``keep`` kept."""
    pool = StorePool("int8", keep=2)
    small, big = {"output": [torch.randn(1, 4, 2, 2)]}, {"output": [torch.randn(1, 4, 4, 4)]}
    a = pool.take(small)
    a.put(small)
    pool.give(a)
    b = pool.take(big)
    assert b is not a  # a's buffers are not re-laid out for big
    b.put(big)
    pool.give(b)
    gens = (a.generation, b.generation)
    for _ in range(3):
        x = pool.take(small)
        y = pool.take(big)
        assert (x, y) == (a, b) and (x.generation, y.generation) == gens
        pool.give(x)
        pool.give(y)
    extra = pool.take({"output": [torch.randn(1, 4, 8, 8)]})
    extra.put({"output": [torch.randn(1, 4, 8, 8)]})
    pool.give(extra)  # a third layout: the least recently returned store is freed
    assert len(pool._free) == 2 and not a.filled
