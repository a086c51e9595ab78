// SPDX-License-Identifier: GPL-3.0-or-later
//
// group_norm_nhwc: y = GroupNorm(x; G groups, affine w, b, eps), optionally followed by SiLU, for
// a channels-last x (B, C, H, W): memory order [B][H*W][C]. The compiled mode keeps activations
// in this layout; PyTorch's and inductor's GroupNorm reduce a group there with strided reads.
//
// Here a group's channels are a short run inside every pixel's row of C values, so a block
// reads whole rows (coalesced) and sorts the values into groups after the reduction:
// 1. stats: grid (S, B). Block (s, b) covers the s-th run of pixels of sample b. Thread (tx, ty)
//    owns NV vectors of V channels (tx, tx + TX, ...) and the pixels ty, ty + RY, ... of the
//    run; per channel it sums its values minus the first one it read (few pixels each, and
//    shifted, so no cancellation), and one warp per group merges those (count, mean, M2)
//    (Chan's formula) into partial[b, s, g].
// 2. finalize: one warp per (b, g) merges its S partials and writes each of the group's
//    channels' mean and scale (rstd * w) as fp32 (B, C, 2).
// 3. apply: flat grid-stride over 16-byte vectors of x; y = (x - mean) * scale + b, then SiLU
//    when asked; fp32 math, one rounding.
// The output has x's layout (channels-last). Accumulation is fp32, as PyTorch's GroupNorm.

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.cuh"

namespace cna {

constexpr int kNhwcThreads = 256;
constexpr int kNhwcMaxChunks = 256;
// At most 384 vectors of V channels (C <= 3072 in fp16): at most 2 per thread (NV), and the
// stats pass's shared memory (RY * C sums, squares and shifts) stays under 48 KiB.
constexpr int kNhwcMaxChannelVectors = 384;

namespace {

struct Stat {
  float n, mean, m2;
};

__device__ __forceinline__ Stat merge(Stat a, Stat b) {
  const float n = a.n + b.n;
  if (n == 0.f) return {0.f, 0.f, 0.f};
  const float delta = b.mean - a.mean;
  const float fb = b.n / n;
  return {n, a.mean + delta * fb, a.m2 + b.m2 + delta * delta * a.n * fb};
}

template <typename T, int V>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[V]) {
  if constexpr (V > 1) {
    const AlignedVec<T, V> a = *reinterpret_cast<const AlignedVec<T, V>*>(p);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = to_float(a.v[k]);
  } else {
    out[0] = to_float(*p);
  }
}

// Shared memory: sums[RY][C] and sqs[RY][C] (floats), then counts[RY].
// Each thread sums its values minus the first one it read of that channel (the shift), so a
// group whose mean is far from zero keeps its variance in fp32.
template <typename T, int V, int NV>
__global__ void __launch_bounds__(kNhwcThreads)
    gn_nhwc_stats_kernel(const T* __restrict__ x, float* __restrict__ partial, int64_t pixels,
                         int channels, int groups, int64_t chunk, int tx_count) {
  extern __shared__ float smem[];
  const int cv_count = channels / V;
  const int ry_count = kNhwcThreads / tx_count;
  const int tx = threadIdx.x % tx_count;
  const int ty = threadIdx.x / tx_count;
  const int s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int64_t p0 = static_cast<int64_t>(s) * chunk;
  const int64_t p1 = min(p0 + chunk, pixels);
  float* sums = smem;
  float* sqs = smem + ry_count * channels;
  float* shifts = sqs + ry_count * channels;
  float* counts = shifts + ry_count * channels;

  float acc[NV][V], acc2[NV][V], shift[NV][V];
#pragma unroll
  for (int i = 0; i < NV; ++i)
#pragma unroll
    for (int k = 0; k < V; ++k) acc[i][k] = acc2[i][k] = shift[i][k] = 0.f;
  float n = 0.f;
  if (ty < ry_count) {
    const T* xb = x + b * pixels * channels;
    if (p0 + ty < p1) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int cv = tx + i * tx_count;
        if (cv < cv_count) load_vec<T, V>(xb + (p0 + ty) * channels + cv * V, shift[i]);
      }
    }
    for (int64_t p = p0 + ty; p < p1; p += ry_count) {
      const T* row = xb + p * channels;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int cv = tx + i * tx_count;
        if (cv < cv_count) {
          float v[V];
          load_vec<T, V>(row + cv * V, v);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const float d = v[k] - shift[i][k];
            acc[i][k] += d;
            acc2[i][k] += d * d;
          }
        }
      }
      n += 1.f;
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int cv = tx + i * tx_count;
      if (cv < cv_count) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int at = ty * channels + cv * V + k;
          sums[at] = acc[i][k];
          sqs[at] = acc2[i][k];
          shifts[at] = shift[i][k];
        }
      }
    }
    if (tx == 0) counts[ty] = n;
  }
  __syncthreads();
  // One warp per group: lanes over (row, channel) entries, then a shuffle merge.
  const int cg = channels / groups;
  const int lane = threadIdx.x & 31;
  const int entries = ry_count * cg;
  for (int g = threadIdx.x >> 5; g < groups; g += kNhwcThreads / 32) {
    Stat t{0.f, 0.f, 0.f};
    for (int e = lane; e < entries; e += 32) {
      const int r = e / cg;
      const float cnt = counts[r];
      if (cnt == 0.f) continue;
      const int at = r * channels + g * cg + e % cg;
      const float sm = sums[at];
      const float dm = sm / cnt;
      t = merge(t, Stat{cnt, shifts[at] + dm, fmaxf(sqs[at] - sm * dm, 0.f)});
    }
    for (int off = 16; off > 0; off >>= 1) {
      const Stat o{__shfl_xor_sync(0xffffffffu, t.n, off),
                   __shfl_xor_sync(0xffffffffu, t.mean, off),
                   __shfl_xor_sync(0xffffffffu, t.m2, off)};
      t = merge(t, o);
    }
    if (lane == 0) {
      float* out = partial + ((b * gridDim.x + s) * groups + g) * 3;
      out[0] = t.n;
      out[1] = t.mean;
      out[2] = t.m2;
    }
  }
}

// One warp per (b, g): lanes over the S partials, a shuffle merge, then the per-channel
// mean and scale (rstd * w) of the group's channels, which the apply pass reads.
template <typename T>
__global__ void gn_nhwc_finalize_kernel(const float* __restrict__ partial, const T* __restrict__ w,
                                        float* __restrict__ chan, int64_t batch, int channels,
                                        int groups, int chunks, float eps) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (i >= batch * groups) return;  // whole warps leave together
  const int64_t b = i / groups;
  const int g = static_cast<int>(i % groups);
  Stat t{0.f, 0.f, 0.f};
  for (int s = lane; s < chunks; s += 32) {
    const float* p = partial + ((b * chunks + s) * groups + g) * 3;
    t = merge(t, Stat{p[0], p[1], p[2]});
  }
  for (int off = 16; off > 0; off >>= 1) {
    const Stat o{__shfl_xor_sync(0xffffffffu, t.n, off), __shfl_xor_sync(0xffffffffu, t.mean, off),
                 __shfl_xor_sync(0xffffffffu, t.m2, off)};
    t = merge(t, o);
  }
  const float rstd = rsqrtf(fmaxf(t.m2 / fmaxf(t.n, 1.f), 0.f) + eps);
  const int cg = channels / groups;
  for (int c = g * cg + lane; c < (g + 1) * cg; c += 32) {
    float* out = chan + (b * channels + c) * 2;
    out[0] = t.mean;
    out[1] = rstd * to_float(w[c]);
  }
}

__device__ __forceinline__ float silu_f(float v) { return v / (1.f + expf(-v)); }

// I: the index type, 32-bit when x has under 2^31 elements. chan: (B, C, 2) mean and scale.
template <typename T, int V, bool SILU, typename I>
__global__ void gn_nhwc_apply_kernel(const T* __restrict__ x, T* __restrict__ y,
                                     const float* __restrict__ chan, const T* __restrict__ bias,
                                     I nvec, I cv_count, I per_sample, int channels) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I j = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; j < nvec; j += stride) {
    const I cv = j % cv_count;
    const I b = j / per_sample;  // per_sample = pixels * cv_count
    const int c0 = static_cast<int>(cv) * V;
    float v[V], bv[V];
    load_vec<T, V>(x + static_cast<int64_t>(j) * V, v);
    load_vec<T, V>(bias + c0, bv);
    const float2* mc = reinterpret_cast<const float2*>(chan) +
                       static_cast<int64_t>(b) * channels + c0;
    AlignedVec<T, V> out;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float2 m = mc[k];
      // (v - m) * sc + b, not v * sc + (b - m * sc): the folded shift cancels badly when
      // |m * sc| >> |b| (a near-constant group has a huge rstd).
      float o = (v[k] - m.x) * m.y + bv[k];
      if constexpr (SILU) o = silu_f(o);
      out.v[k] = from_float<T>(o);
    }
    if constexpr (V > 1) {
      reinterpret_cast<AlignedVec<T, V>*>(y)[j] = out;
    } else {
      y[j] = out.v[0];
    }
  }
}

template <typename T, int V, int NV>
void launch_stats(const T* xp, float* partial, int64_t P, int C, int G, int64_t chunk, int S,
                  int64_t B, int tx, cudaStream_t stream) {
  const int ry = kNhwcThreads / tx;
  const size_t shmem = (static_cast<size_t>(ry) * C * 3 + ry) * sizeof(float);
  gn_nhwc_stats_kernel<T, V, NV><<<dim3(S, static_cast<unsigned>(B)), kNhwcThreads, shmem,
                                   stream>>>(xp, partial, P, C, G, chunk, tx);
}

template <typename T, int V, bool SILU>
void launch_apply(const T* xp, T* yp, const float* chan, const T* bp, int64_t n, int64_t P, int C,
                  cudaStream_t stream) {
  const int64_t nvec = n / V;
  const int64_t cv = C / V;
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((nvec + 255) / 256, int64_t{sm_count()} * 8));
  if (n < (int64_t{1} << 31))
    gn_nhwc_apply_kernel<T, V, SILU, uint32_t><<<blocks, 256, 0, stream>>>(
        xp, yp, chan, bp, static_cast<uint32_t>(nvec), static_cast<uint32_t>(cv),
        static_cast<uint32_t>(P * cv), C);
  else
    gn_nhwc_apply_kernel<T, V, SILU, int64_t>
        <<<blocks, 256, 0, stream>>>(xp, yp, chan, bp, nvec, cv, P * cv, C);
}

template <typename T, int V>
void run_nhwc(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& weight,
              const torch::Tensor& bias, int G, double eps, bool silu, cudaStream_t stream) {
  const int64_t B = x.size(0);
  const int C = static_cast<int>(x.size(1));
  const int64_t P = x.numel() / (B * C);
  const int cv = C / V;
  const int nv = (cv + kNhwcThreads - 1) / kNhwcThreads;  // 1 or 2 (checked by the caller)
  const int tx = (cv + nv - 1) / nv;
  const int ry = kNhwcThreads / tx;
  // Enough blocks for every multiprocessor twice over, each at least one pass of its rows.
  int64_t S = (2 * int64_t{sm_count()} + B - 1) / B;
  S = std::max<int64_t>(1, std::min<int64_t>({S, kNhwcMaxChunks, (P + ry - 1) / ry}));
  const int64_t chunk = (P + S - 1) / S;
  S = (P + chunk - 1) / chunk;
  auto opts = x.options().dtype(torch::kFloat);
  auto partial = torch::empty({B, S, G, 3}, opts);
  auto chan = torch::empty({B, C, 2}, opts);
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  const T* wp = reinterpret_cast<const T*>(weight.data_ptr());
  const T* bp = reinterpret_cast<const T*>(bias.data_ptr());
  float* pp = partial.data_ptr<float>();
  switch (nv) {
    case 1: launch_stats<T, V, 1>(xp, pp, P, C, G, chunk, static_cast<int>(S), B, tx, stream); break;
    default: launch_stats<T, V, 2>(xp, pp, P, C, G, chunk, static_cast<int>(S), B, tx, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t warps = B * G;
  gn_nhwc_finalize_kernel<T><<<static_cast<unsigned>((warps * 32 + 127) / 128), 128, 0, stream>>>(
      pp, wp, chan.data_ptr<float>(), B, C, G, static_cast<int>(S), static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (silu)
    launch_apply<T, V, true>(xp, yp, chan.data_ptr<float>(), bp, x.numel(), P, C, stream);
  else
    launch_apply<T, V, false>(xp, yp, chan.data_ptr<float>(), bp, x.numel(), P, C, stream);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

torch::Tensor group_norm_nhwc(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, int64_t groups, double eps, bool silu) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && x.is_contiguous(at::MemoryFormat::ChannelsLast),
              "group_norm_nhwc: x must be a channels-last CUDA tensor (B, C, H, W)");
  const int64_t C = x.size(1);
  CNA_CHECK(groups > 0 && C % groups == 0, "group_norm_nhwc: C=%lld is not divisible by groups=%lld",
            static_cast<long long>(C), static_cast<long long>(groups));
  TORCH_CHECK(weight.is_cuda() && bias.is_cuda() && weight.numel() == C && bias.numel() == C &&
                  weight.scalar_type() == x.scalar_type() &&
                  bias.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
                  bias.is_contiguous(),
              "group_norm_nhwc: weight and bias must be contiguous (C,) CUDA tensors of x's dtype");
  auto y = torch::empty_like(x, at::MemoryFormat::ChannelsLast);
  if (x.numel() == 0) return y;
  const c10::cuda::CUDAGuard guard(x.device());
  auto stream = c10::cuda::getCurrentCUDAStream();

#define CNA_GN_NHWC(T)                                                                          \
  do {                                                                                          \
    constexpr int V = 16 / sizeof(T);                                                           \
    const bool vec = C % V == 0 && aligned_to(x.data_ptr(), 16) && aligned_to(y.data_ptr(), 16) && \
                     aligned_to(weight.data_ptr(), 16) && aligned_to(bias.data_ptr(), 16);      \
    const int64_t vecs = vec ? C / V : C;                                                       \
    CNA_CHECK(vecs <= kNhwcMaxChannelVectors,                                                   \
              "group_norm_nhwc: C=%lld is over the kernel's channel limit",                     \
              static_cast<long long>(C));                                                       \
    if (vec)                                                                                    \
      run_nhwc<T, V>(x, y, weight, bias, static_cast<int>(groups), eps, silu, stream);          \
    else                                                                                        \
      run_nhwc<T, 1>(x, y, weight, bias, static_cast<int>(groups), eps, silu, stream);          \
  } while (0)

  switch (x.scalar_type()) {
    case at::kHalf:
      CNA_GN_NHWC(__half);
      break;
    case at::kBFloat16:
      CNA_GN_NHWC(__nv_bfloat16);
      break;
    case at::kFloat:
      CNA_GN_NHWC(float);
      break;
    default:
      TORCH_CHECK(false, "group_norm_nhwc: dtype must be float16, bfloat16 or float32");
  }
#undef CNA_GN_NHWC
  return y;
}

}  // namespace cna
