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
//    (a vector then never straddles two channels), 32-bit index math under 2^31 elements.
//    fp32 math, one rounding.
// The stats pass also reads 16-byte vectors when the group size allows (see gn_stats_kernel).
// Accumulation is fp32 Welford throughout (as PyTorch's GroupNorm), so a large mean does not
// cancel the variance.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

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

// VEC: 16-byte loads (V elements), each vector folded into the running Welford state as one
// batch (its own mean and M2, then Chan's combine): one division per V elements. The host picks
// it when the group size is a multiple of V and x is 16-byte aligned (chunks are then whole
// vectors).
template <typename T, bool VEC>
__global__ void __launch_bounds__(kGThreads)
    gn_stats_kernel(const T* __restrict__ x, float* __restrict__ partial, int64_t group_size,
                    int64_t chunk) {
  constexpr int V = 16 / sizeof(T);
  const int64_t g = blockIdx.x;
  const int s = blockIdx.y;
  const int64_t begin = static_cast<int64_t>(s) * chunk;
  const int64_t end = min(begin + chunk, group_size);
  const T* xg = x + g * group_size;
  Welford w{0.f, 0.f, 0.f};
  if constexpr (VEC) {
    const AlignedVec<T, V>* xv = reinterpret_cast<const AlignedVec<T, V>*>(xg + begin);
    const int64_t nvec = (end - begin) / V;
    for (int64_t j = threadIdx.x; j < nvec; j += blockDim.x) {
      const AlignedVec<T, V> a = xv[j];
      float vals[V];
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        vals[k] = to_float(a.v[k]);
        sum += vals[k];
      }
      const float vm = sum * (1.f / V);
      float m2 = 0.f;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const float d = vals[k] - vm;
        m2 += d * d;
      }
      w = combine(w, Welford{static_cast<float>(V), vm, m2});
    }
  } else {
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x) {
      const float v = to_float(xg[j]);
      w.n += 1.f;
      const float d = v - w.mean;
      w.mean += d / w.n;
      w.m2 += d * (v - w.mean);
    }
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

// I: the index type, 32-bit when the tensor has under 2^31 elements (always at SD shapes: the
// three divisions per vector are then cheap), else 64-bit.
template <typename T, int V, typename I>
__global__ void gn_apply_kernel(const T* __restrict__ x, T* __restrict__ y,
                                const float* __restrict__ mean, const float* __restrict__ rstd,
                                const T* __restrict__ w, const T* __restrict__ b, I n, I hw,
                                I channels, I cg) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const I nv = n / V;
  for (I j = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; j < nv; j += stride) {
    const I e = j * V;
    const I bc = e / hw;  // b * C + c
    const I c = bc % channels;
    const I grp = bc / cg;  // b * G + g (channels of a group are consecutive)
    const float m = mean[grp], r = rstd[grp];
    const float sc = r * to_float(w[c]);
    // (v - m) * sc + b, not v * sc + (b - m * sc): the folded shift cancels badly when
    // |m * sc| >> |b| (a near-constant group has a huge rstd).
    const float sh = to_float(b[c]);
    if constexpr (V > 1) {
      using Vec = AlignedVec<T, V>;
      const Vec in = reinterpret_cast<const Vec*>(x)[j];
      Vec out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = from_float<T>(silu((to_float(in.v[k]) - m) * sc + sh));
      reinterpret_cast<Vec*>(y)[j] = out;
    } else {
      y[e] = from_float<T>(silu((to_float(x[e]) - m) * sc + sh));
    }
  }
}

at::Tensor group_norm_silu(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, int64_t groups, double eps) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.dim() >= 2,
              "group_norm_silu: x must be a contiguous CUDA tensor (B, C, ...)");
  const int64_t B = x.size(0), C = x.size(1);
  CNA_CHECK(groups > 0 && C % groups == 0, "group_norm_silu: C=%lld is not divisible by groups=%lld",
            static_cast<long long>(C), static_cast<long long>(groups));
  TORCH_CHECK(weight.is_cuda() && bias.is_cuda() && weight.numel() == C && bias.numel() == C &&
                  weight.scalar_type() == x.scalar_type() &&
                  bias.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  bias.is_contiguous(),
              "group_norm_silu: weight and bias must be contiguous (C,) CUDA tensors of x's dtype");
  auto y = at::empty_like(x);
  const int64_t n = x.numel();
  if (n == 0) return y;
  const int64_t hw = n / (B * C);
  const int64_t cg = C / groups;
  const int64_t group_size = cg * hw;
  const int64_t ngroups = B * groups;
  int64_t chunks = (group_size + kGThreads * kItemsPerThread - 1) / (kGThreads * kItemsPerThread);
  chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, kMaxChunks));
  // Vector loads need whole vectors per chunk: round the chunk up to a multiple of 16 elements
  // (a multiple of every V) and recount the chunks.
  const int64_t chunk = ((group_size + chunks - 1) / chunks + 15) / 16 * 16;
  chunks = (group_size + chunk - 1) / chunk;
  const c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options().dtype(at::kFloat);
  auto partial = at::empty({ngroups, chunks, 3}, opts);
  auto mean = at::empty({ngroups}, opts);
  auto rstd = at::empty({ngroups}, opts);
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
    constexpr int V = 16 / sizeof(T);                                                           \
    if (group_size % V == 0 && aligned_to(xp, 16))                                              \
      gn_stats_kernel<T, true><<<sgrid, kGThreads, 0, stream>>>(xp, partial.data_ptr<float>(),  \
                                                                 group_size, chunk);            \
    else                                                                                        \
      gn_stats_kernel<T, false><<<sgrid, kGThreads, 0, stream>>>(xp, partial.data_ptr<float>(), \
                                                                  group_size, chunk);           \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                             \
    gn_finalize_kernel<<<fin_blocks, 128, 0, stream>>>(partial.data_ptr<float>(),               \
                                                       mean.data_ptr<float>(),                  \
                                                       rstd.data_ptr<float>(), ngroups,         \
                                                       static_cast<int>(chunks),                \
                                                       static_cast<float>(eps));                \
    C10_CUDA_KERNEL_LAUNCH_CHECK();                                                             \
    const bool vec = hw % V == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0 &&                \
                     reinterpret_cast<uintptr_t>(yp) % 16 == 0;                                 \
    const int64_t work = vec ? n / V : n;                                                       \
    const int64_t blocks = std::max<int64_t>(                                                   \
        1, std::min<int64_t>((work + 255) / 256, static_cast<int64_t>(sms) * 8));               \
    const bool small = n < (int64_t{1} << 31);                                                  \
    if (vec && small)                                                                           \
      gn_apply_kernel<T, V, uint32_t><<<blocks, 256, 0, stream>>>(                              \
          xp, yp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, bp, n, hw, C, cg);        \
    else if (vec)                                                                               \
      gn_apply_kernel<T, V, int64_t><<<blocks, 256, 0, stream>>>(                               \
          xp, yp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, bp, n, hw, C, cg);        \
    else if (small)                                                                             \
      gn_apply_kernel<T, 1, uint32_t><<<blocks, 256, 0, stream>>>(                              \
          xp, yp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, bp, n, hw, C, cg);        \
    else                                                                                        \
      gn_apply_kernel<T, 1, int64_t><<<blocks, 256, 0, stream>>>(                               \
          xp, yp, mean.data_ptr<float>(), rstd.data_ptr<float>(), wp, bp, n, hw, C, cg);        \
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
