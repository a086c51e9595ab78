// SPDX-License-Identifier: GPL-3.0-or-later
//
// control_merge: out[k] = sum_i s[i] * r[i][k]  (or hidden[k] += that), for every residual slot
// of a UNet ControlNet (13 for SD1.5, 10 for SDXL) over N chained nets, in ONE launch.
//
// Layout: each slot is a contiguous tensor (any shape, NCHW as ComfyUI produces them); slots
// differ in size. The pointer table travels by value in the kernel's parameters (MergeArgs,
// under 2 KB), so a CUDA graph captures it with the launch and replays need no host work.
// Strengths are read from a device array at run time: changing them needs no recapture.
//
// Grid: blockIdx.y = slot, blockIdx.x strides over that slot's elements; 256 threads a block.
// Access: 16-byte vector loads/stores (8 fp16/bf16 or 4 fp32 elements) when every pointer of
// the slot is 16-byte aligned and the slot's size is a multiple of the vector width (always
// true for SD shapes); otherwise a scalar loop. Accumulation in fp32, one rounding at the end.
// Memory-bound: (N + 1) reads (+1 for accumulate) and one write per element.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.cuh"

namespace cna {

constexpr int kMaxSlots = 32;
constexpr int kMaxNets = 4;
constexpr int kThreads = 256;

struct MergeArgs {
  const void* res[kMaxNets][kMaxSlots];
  void* out[kMaxSlots];
  int64_t numel[kMaxSlots];
  uint32_t vec_mask;  // bit k: slot k may use 16-byte vectors
  int num_nets;
  int accumulate;
};

template <typename T>
__global__ void __launch_bounds__(kThreads)
    control_merge_kernel(const MergeArgs a, const float* __restrict__ strengths) {
  const int slot = blockIdx.y;
  const int64_t n = a.numel[slot];
  float s[kMaxNets];
#pragma unroll
  for (int i = 0; i < kMaxNets; ++i) s[i] = i < a.num_nets ? strengths[i] : 0.f;
  T* out = static_cast<T*>(a.out[slot]);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  if (a.vec_mask & (1u << slot)) {
    constexpr int V = 16 / sizeof(T);
    using Vec = AlignedVec<T, V>;
    const int64_t nv = n / V;
    for (int64_t j = tid; j < nv; j += stride) {
      float acc[V];
      if (a.accumulate) {
        const Vec h = reinterpret_cast<const Vec*>(out)[j];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = to_float(h.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = 0.f;
      }
      for (int i = 0; i < a.num_nets; ++i) {
        const Vec r = reinterpret_cast<const Vec*>(a.res[i][slot])[j];
#pragma unroll
        for (int e = 0; e < V; ++e) acc[e] = fmaf(s[i], to_float(r.v[e]), acc[e]);
      }
      Vec o;
#pragma unroll
      for (int e = 0; e < V; ++e) o.v[e] = from_float<T>(acc[e]);
      reinterpret_cast<Vec*>(out)[j] = o;
    }
  } else {
    for (int64_t j = tid; j < n; j += stride) {
      float acc = a.accumulate ? to_float(out[j]) : 0.f;
      for (int i = 0; i < a.num_nets; ++i)
        acc = fmaf(s[i], to_float(static_cast<const T*>(a.res[i][slot])[j]), acc);
      out[j] = from_float<T>(acc);
    }
  }
}

static void launch(const std::vector<at::Tensor>& residuals, const at::Tensor& strengths,
                   const std::vector<at::Tensor>& outs, int64_t num_nets, bool accumulate) {
  const int64_t slots = static_cast<int64_t>(outs.size());
  CNA_CHECK(num_nets >= 1 && num_nets <= kMaxNets, "control_merge: num_nets must be 1..%d, got %lld",
            kMaxNets, static_cast<long long>(num_nets));
  CNA_CHECK(slots >= 1 && slots <= kMaxSlots, "control_merge: slots must be 1..%d, got %lld",
            kMaxSlots, static_cast<long long>(slots));
  CNA_CHECK(static_cast<int64_t>(residuals.size()) == num_nets * slots,
            "control_merge: residuals must hold num_nets * slots tensors (net-major), got %zu "
            "for %lld x %lld",
            residuals.size(), static_cast<long long>(num_nets), static_cast<long long>(slots));
  TORCH_CHECK(strengths.is_cuda() && strengths.scalar_type() == at::kFloat &&
                  strengths.numel() >= num_nets && strengths.is_contiguous(),
              "control_merge: strengths must be a contiguous float32 CUDA tensor of >= num_nets");
  const auto dtype = outs[0].scalar_type();
  const auto device = outs[0].device();
  MergeArgs a{};
  a.num_nets = static_cast<int>(num_nets);
  a.accumulate = accumulate ? 1 : 0;
  int64_t max_n = 0;
  for (int64_t k = 0; k < slots; ++k) {
    const auto& o = outs[k];
    CNA_CHECK(o.is_cuda() && o.device() == device, "control_merge: out[%lld] is on another device",
              static_cast<long long>(k));
    CNA_CHECK(o.scalar_type() == dtype, "control_merge: out[%lld] dtype differs",
              static_cast<long long>(k));
    CNA_CHECK(o.is_contiguous(), "control_merge: out[%lld] must be contiguous",
              static_cast<long long>(k));
    bool vec = (reinterpret_cast<uintptr_t>(o.data_ptr()) % 16 == 0) &&
               ((o.numel() * o.element_size()) % 16 == 0);
    for (int64_t i = 0; i < num_nets; ++i) {
      const auto& r = residuals[i * slots + k];
      CNA_CHECK(r.is_cuda() && r.device() == device && r.scalar_type() == dtype &&
                    r.is_contiguous() && r.sizes() == o.sizes(),
                "control_merge: residual[net %lld][slot %lld] must be a contiguous CUDA tensor "
                "of the output's dtype and shape",
                static_cast<long long>(i), static_cast<long long>(k));
      a.res[i][k] = r.data_ptr();
      vec = vec && (reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0);
    }
    a.out[k] = o.data_ptr();
    a.numel[k] = o.numel();
    if (vec) a.vec_mask |= (1u << k);
    max_n = std::max(max_n, o.numel());
  }
  if (max_n == 0) return;
  const c10::cuda::CUDAGuard guard(device);
  const int sms = sm_count();
  // Enough blocks in x for the largest slot at 8 elements a thread, capped at ~4 waves.
  int64_t bx = (max_n + kThreads * 8 - 1) / (kThreads * 8);
  bx = std::max<int64_t>(1, std::min<int64_t>(bx, static_cast<int64_t>(sms) * 4));
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(slots));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float* sp = strengths.data_ptr<float>();
  switch (dtype) {
    case at::kHalf:
      control_merge_kernel<__half><<<grid, kThreads, 0, stream>>>(a, sp);
      break;
    case at::kBFloat16:
      control_merge_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a, sp);
      break;
    case at::kFloat:
      control_merge_kernel<float><<<grid, kThreads, 0, stream>>>(a, sp);
      break;
    default:
      CNA_CHECK(false, "control_merge: dtype must be float16, bfloat16 or float32, got %s",
                c10::toString(dtype));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<at::Tensor> control_merge(const std::vector<at::Tensor>& residuals,
                                         const at::Tensor& strengths, int64_t num_nets) {
  TORCH_CHECK(num_nets >= 1 && !residuals.empty() && residuals.size() % num_nets == 0,
              "control_merge: residuals must hold num_nets * slots tensors");
  const int64_t slots = static_cast<int64_t>(residuals.size()) / num_nets;
  std::vector<at::Tensor> outs;
  outs.reserve(slots);
  for (int64_t k = 0; k < slots; ++k) outs.push_back(at::empty_like(residuals[k]));
  launch(residuals, strengths, outs, num_nets, false);
  return outs;
}

void control_merge_add_(const std::vector<at::Tensor>& hidden,
                        const std::vector<at::Tensor>& residuals,
                        const at::Tensor& strengths) {
  TORCH_CHECK(!hidden.empty() && residuals.size() % hidden.size() == 0,
              "control_merge_add_: residuals must hold num_nets * len(hidden) tensors");
  const int64_t num_nets = static_cast<int64_t>(residuals.size() / hidden.size());
  launch(residuals, strengths, hidden, num_nets, true);
}

}  // namespace cna
