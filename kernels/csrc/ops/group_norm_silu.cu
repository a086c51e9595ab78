// SPDX-License-Identifier: GPL-3.0-or-later
//
// group_norm_silu: y = SiLU(GroupNorm(x; G groups, affine w, b, eps)) for x (B, C, *spatial),
// the ResBlock prologue of SD UNets and ControlNets, in three launches instead of PyTorch's
// GroupNorm (moments + fused params + apply) followed by a separate SiLU pass over the tensor.
//
// Layout: contiguous NCHW. Group (b, g) is one contiguous run of Cg*HW elements (Cg = C/G).
// 1. stats: grid (B*G, S). Block (n, s) runs Welford over the s-th chunk of group n (256
//    threads, each over strided elements), combines its threads (warp shuffles, then shared
//    memory, Chan's formula) and writes (count, mean, M2) to partial[n, s]. S chunks per group
//    keep all SMs busy: at SD 512² a group is 40960 elements, 64 groups x ~10 chunks.
// 2. finalize: one thread per group combines its S partials into mean and rstd (fp32).
// 3. apply: flat grid-stride over x; 16-byte vectors when HW is a multiple of the vector width
//    (a vector then never straddles two channels). fp32 math, one rounding.
// Accumulation is fp32 Welford throughout (as PyTorch's GroupNorm), so a large mean does not
// cancel the variance.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.cuh"

namespace cna {

constexpr int kGThreads = 256;
constexpr int kItemsPerThread = 16;
constexpr int kMaxChunks = 64;

struct Welford {
  float n, mean, m2;
};

__device__ __forceinline__ Welford combine(Welford a, Welford b) {
  const float n = a.n + b.n;
  if (n == 0.f) return {0.f, 0.f, 0.f};
  const float delta = b.mean - a.mean;
  const float fb = b.n / n;
  return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

template <typename T>
__global__ void __launch_bounds__(kGThreads)
    gn_stats_kernel(const T* __restrict__ x, float* __restrict__ partial, int64_t group_size,
                    int64_t chunk) {
  const int64_t g = blockIdx.x;
  const int s = blockIdx.y;
  const int64_t begin = static_cast<int64_t>(s) * chunk;
  const int64_t end = min(begin + chunk, group_size);
  const T* xg = x + g * group_size;
  Welford w{0.f, 0.f, 0.f};
  for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
    const float v = to_float(xg[j]);
    w.n += 1.f;
    const float d = v - w.mean;
    w.mean += d / w.n;
    w.m2 += d * (v - w.mean);
  }
  for (int off = 16; off > 0; off >>= 1) {
    Welford o{__shfl_xor_sync(0xffffffffu, w.n, off), __shfl_xor_sync(0xffffffffu, w.mean, off),
              __shfl_xor_sync(0xffffffffu, w.m2, off)};
    w = combine(w, o);
  }
  __shared__ Welford warps[kGThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = w;
  __syncthreads();
  if (threadIdx.x == 0) {
    Welford t = warps[0];
    for (int i = 1; i < kGThreads / 32; ++i) t = combine(t, warps[i]);
    float* p = partial + (g * gridDim.y + s) * 3;
    p[0] = t.n;
    p[1] = t.mean;
    p[2] = t.m2;
  }
}

__global__ void gn_finalize_kernel(const float* __restrict__ partial, float* __restrict__ mean,
                                   float* __restrict__ rstd, int64_t groups, int chunks,
                                   float eps) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  Welford t{0.f, 0.f, 0.f};
  for (int s = 0; s < chunks; ++s) {
    const float* p = partial + (g * chunks + s) * 3;
    t = combine(t, Welford{p[0], p[1], p[2]});
  }
  mean[g] = t.mean;
  rstd[g] = rsqrtf(fmaxf(t.m2 / fmaxf(t.n, 1.f), 0.f) + eps);
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

template <typename T, int V>
__global__ void gn_apply_kernel(const T* __restrict__ x, T* __restrict__ y,
                                const float* __restrict__ mean, const float* __restrict__ rstd,
                                const T* __restrict__ w, const T* __restrict__ b, int64_t n,
                                int64_t hw, int64_t channels, int64_t cg) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nv = n / V;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < nv;
       j += stride) {
    const int64_t e = j * V;
    const int64_t bc = e / hw;  // b * C + c
    const int64_t c = bc % channels;
    const int64_t grp = bc / cg;  // b * G + g (channels of a group are consecutive)
    const float m = mean[grp], r = rstd[grp];
    const float sc = r * to_float(w[c]);
    const float sh = to_float(b[c]) - m * sc;
    if constexpr (V > 1) {
      using Vec = AlignedVec<T, V>;
      const Vec in = reinterpret_cast<const Vec*>(x)[j];
      Vec out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = from_float<T>(silu(to_float(in.v[k]) * sc + sh));
      reinterpret_cast<Vec*>(y)[j] = out;
    } else {
      y[e] = from_float<T>(silu(to_float(x[e]) * sc + sh));
    }
  }
}

torch::Tensor group_norm_silu(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, int64_t groups, double eps) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 2,
              "group_norm_silu: x must be a contiguous CUDA tensor (B, C, ...)");
  const int64_t B = x.size(0), C = x.size(1);
  TORCH_CHECK(groups > 0 && C % groups == 0, "group_norm_silu: C=", C,
              " is not divisible by groups=", groups);
  TORCH_CHECK(weight.is_cuda() && bias.is_cuda() && weight.numel() == C && bias.numel() == C &&
                  weight.scalar_type() == x.scalar_type() &&
                  bias.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  bias.is_contiguous(),
              "group_norm_silu: weight and bias must be contiguous (C,) CUDA tensors of x's dtype");
  auto y = torch::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  const int64_t hw = n / (B * C);
  const int64_t cg = C / groups;
  const int64_t group_size = cg * hw;
  const int64_t ngroups = B * groups;
  int64_t chunks = (group_size + kGThreads * kItemsPerThread - 1) / (kGThreads * kItemsPerThread);
  chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, kMaxChunks));
  const int64_t chunk = (group_size + chunks - 1) / chunks;
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options().dtype(torch::kFloat);
  auto partial = torch::empty({ngroups, chunks, 3}, opts);
  auto mean = torch::empty({ngroups}, opts);
  auto rstd = torch::empty({ngroups}, opts);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int sms = sm_count();
  const dim3 sgrid(static_cast<unsigned>(ngroups), static_cast<unsigned>(chunks));
  const int fin_blocks = static_cast<int>((ngroups + 127) / 128);

#define CNA_GN_LAUNCH(T)                                                                        \
  do {                                                                                          \
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());                                     \
    T* yp = reinterpret_cast<T*>(y.data_ptr());                                                 \
    const T* wp = reinterpret_cast<const T*>(weight.data_ptr());                                \
    const T* bp = reinterpret_cast<const T*>(bias.data_ptr());                                  \
    gn_stats_kernel<T><<<sgrid, kGThreads, 0, stream>>>(xp, partial.data_ptr<float>(),          \
                                                         group_size, chunk);                    \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                             \
    gn_finalize_kernel<<<fin_blocks, 128, 0, stream>>>(partial.data_ptr<float>(),               \
                                                       mean.data_ptr<float>(),                  \
                                                       rstd.data_ptr<float>(), ngroups,         \
                                                       static_cast<int>(chunks),                \
                                                       static_cast<float>(eps));                \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                             \
    constexpr int V = 16 / sizeof(T);                                                           \
    const bool vec = hw % V == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&                \
                     reinterpret_cast<uintptr_t>(yp) % 16 == 0;                                 \
    const int64_t work = vec ? n / V : n;                                                       \
    const int64_t blocks = std::max<int64_t>(                                                   \
        1, std::min<int64_t>((work + 255) / 256, static_cast<int64_t>(sms) * 8));               \
    if (vec)                                                                                    \
      gn_apply_kernel<T, V><<<blocks, 256, 0, stream>>>(xp, yp, mean.data_ptr<float>(),         \
                                                        rstd.data_ptr<float>(), wp, bp, n, hw,  \
                                                        C, cg);                                 \
    else                                                                                        \
      gn_apply_kernel<T, 1><<<blocks, 256, 0, stream>>>(xp, yp, mean.data_ptr<float>(),         \
                                                        rstd.data_ptr<float>(), wp, bp, n, hw,  \
                                                        C, cg);                                 \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                             \
  } while (0)

  switch (x.scalar_type()) {
    case at::kHalf:
      CNA_GN_LAUNCH(__half);
      break;
    case at::kBFloat16:
      CNA_GN_LAUNCH(__nv_bfloat16);
      break;
    case at::kFloat:
      CNA_GN_LAUNCH(float);
      break;
    default:
      TORCH_CHECK(false, "group_norm_silu: dtype must be float16, bfloat16 or float32");
  }
#undef CNA_GN_LAUNCH
  return y;
}

}  // namespace cna
