// SPDX-License-Identifier: GPL-3.0-or-later
//
// quantize_int8: symmetric INT8 with one scale per (sample, channel) plane.
//   scale[b,c] = max|x[b,c,:]| / 127;  q = clamp(round_half_even(x / scale), -127, 127)
//   (an all-zero plane gets scale 0 and q 0).
// dequant_add_: h[b,c,:] += strength * scale[b,c] * q[b,c,:], fp32 math, one rounding.
//
// Layout: contiguous (B, C, *spatial); a plane is C-contiguous HW elements.
// quantize: one block (256 threads) per plane; pass 1 reduces max|x| (warp shuffles, then
// shared memory), pass 2 writes q. Planes are 4K-64K elements at SD shapes, read twice (the
// second read mostly from L2). dequant_add_: flat grid-stride over all elements, plane index
// = element / HW. Both memory-bound: 16-byte loads of x/h and 8-byte (fp16/bf16) or 4-byte
// (fp32) int8 accesses whenever HW is a multiple of the vector width (always at SD shapes);
// scalar otherwise. Strength is a device scalar (no recapture on change).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.cuh"

namespace cna {

constexpr int kQThreads = 256;

__device__ __forceinline__ int8_t quant1(float v, float inv) {
  const float r = rintf(v * inv);  // round half to even, as torch.round
  return static_cast<int8_t>(fminf(fmaxf(r, -127.f), 127.f));
}

// VEC: 16-byte loads of x (V = 16 / sizeof(T) elements) and V-byte stores of q; the host picks
// it when the plane size is a multiple of V and both base pointers are aligned.
template <typename T, bool VEC>
__global__ void __launch_bounds__(kQThreads)
    quantize_kernel(const T* __restrict__ x, int8_t* __restrict__ q, float* __restrict__ scale,
                    int64_t plane) {
  constexpr int V = 16 / sizeof(T);
  using Vec = AlignedVec<T, V>;
  using QVec = I8Vec<V>;
  const int64_t p = blockIdx.x;
  const T* xp = x + p * plane;
  int8_t* qp = q + p * plane;
  float m = 0.f;
  if constexpr (VEC) {
    const Vec* xv = reinterpret_cast<const Vec*>(xp);
    for (int64_t j = threadIdx.x; j < plane / V; j += blockDim.x) {
      const Vec a = xv[j];
#pragma unroll
      for (int k = 0; k < V; ++k) m = fmaxf(m, fabsf(to_float(a.v[k])));
    }
  } else {
    for (int64_t j = threadIdx.x; j < plane; j += blockDim.x) m = fmaxf(m, fabsf(to_float(xp[j])));
  }
  __shared__ float warp_max[kQThreads / 32];
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
  __syncthreads();
  if (threadIdx.x < 32) {
    m = threadIdx.x < kQThreads / 32 ? warp_max[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (threadIdx.x == 0) warp_max[0] = m;
  }
  __syncthreads();
  const float amax = warp_max[0];
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  if (threadIdx.x == 0) scale[p] = amax / 127.f;
  if constexpr (VEC) {
    const Vec* xv = reinterpret_cast<const Vec*>(xp);
    QVec* qv = reinterpret_cast<QVec*>(qp);
    for (int64_t j = threadIdx.x; j < plane / V; j += blockDim.x) {
      const Vec a = xv[j];
      QVec o;
#pragma unroll
      for (int k = 0; k < V; ++k) o.v[k] = quant1(to_float(a.v[k]), inv);
      qv[j] = o;
    }
  } else {
    for (int64_t j = threadIdx.x; j < plane; j += blockDim.x) qp[j] = quant1(to_float(xp[j]), inv);
  }
}

// V elements per thread step, all in one plane (the host picks V > 1 only when the plane size
// is a multiple of V and the pointers are aligned), so one division finds the plane for V.
template <typename T, int V>
__global__ void dequant_add_kernel(T* __restrict__ h, const int8_t* __restrict__ q,
                                   const float* __restrict__ scale,
                                   const float* __restrict__ strength, int64_t n, int64_t plane) {
  const float s = strength[0];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t nv = n / V, plane_v = plane / V;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < nv;
       j += stride) {
    const float f = s * scale[j / plane_v];
    if constexpr (V > 1) {
      AlignedVec<T, V> a = reinterpret_cast<AlignedVec<T, V>*>(h)[j];
      const I8Vec<V> b = reinterpret_cast<const I8Vec<V>*>(q)[j];
#pragma unroll
      for (int k = 0; k < V; ++k)
        a.v[k] = from_float<T>(to_float(a.v[k]) + f * static_cast<float>(b.v[k]));
      reinterpret_cast<AlignedVec<T, V>*>(h)[j] = a;
    } else {
      h[j] = from_float<T>(to_float(h[j]) + f * static_cast<float>(q[j]));
    }
  }
}

std::vector<at::Tensor> quantize_int8(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "quantize_int8: x must be a CUDA tensor");
  CNA_CHECK(x.dim() >= 2, "quantize_int8: x must be (B, C, ...), got %lld dims",
            static_cast<long long>(x.dim()));
  TORCH_CHECK(x.is_contiguous(), "quantize_int8: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto scale = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return {q, scale};
  const int64_t plane = x.numel() / planes;
  auto stream = c10::cuda::getCurrentCUDAStream();
#define CNA_Q_LAUNCH(T)                                                                         \
  do {                                                                                          \
    constexpr int V = 16 / sizeof(T);                                                           \
    const T* xp = reinterpret_cast<const T*>(x.data_ptr());                                     \
    int8_t* qp = q.data_ptr<int8_t>();                                                          \
    if (plane % V == 0 && aligned_to(xp, 16) && aligned_to(qp, V))                              \
      quantize_kernel<T, true><<<planes, kQThreads, 0, stream>>>(xp, qp, scale.data_ptr<float>(), \
                                                                  plane);                       \
    else                                                                                        \
      quantize_kernel<T, false><<<planes, kQThreads, 0, stream>>>(xp, qp,                       \
                                                                   scale.data_ptr<float>(), plane); \
  } while (0)
  switch (x.scalar_type()) {
    case at::kHalf:
      CNA_Q_LAUNCH(__half);
      break;
    case at::kBFloat16:
      CNA_Q_LAUNCH(__nv_bfloat16);
      break;
    case at::kFloat:
      CNA_Q_LAUNCH(float);
      break;
    default:
      CNA_CHECK(false, "quantize_int8: dtype must be float16, bfloat16 or float32, got %s",
                c10::toString(x.scalar_type()));
  }
#undef CNA_Q_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

void dequant_add_(const at::Tensor& h, const at::Tensor& q, const at::Tensor& scale,
                  const at::Tensor& strength) {
  TORCH_CHECK(h.is_cuda() && q.is_cuda() && scale.is_cuda() && strength.is_cuda(),
              "dequant_add_: all tensors must be on CUDA");
  TORCH_CHECK(h.device() == q.device() && h.device() == scale.device() &&
                  h.device() == strength.device(),
              "dequant_add_: all tensors must be on one device");
  TORCH_CHECK(h.is_contiguous() && q.is_contiguous() && scale.is_contiguous(),
              "dequant_add_: h, q and scale must be contiguous");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.sizes() == h.sizes(),
              "dequant_add_: q must be int8 with h's shape");
  TORCH_CHECK(h.dim() >= 2 && scale.scalar_type() == at::kFloat &&
                  scale.numel() == h.size(0) * h.size(1),
              "dequant_add_: scale must be float32 (B, C)");
  TORCH_CHECK(strength.scalar_type() == at::kFloat && strength.numel() == 1,
              "dequant_add_: strength must be a float32 scalar tensor");
  const int64_t n = h.numel();
  if (n == 0) return;
  const int64_t plane = n / (h.size(0) * h.size(1));
  const c10::cuda::CUDAGuard guard(h.device());
  const int sms = sm_count();
  const int threads = 256;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float* sc = scale.data_ptr<float>();
  const float* st = strength.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
#define CNA_DQ_LAUNCH(T)                                                                        \
  do {                                                                                          \
    constexpr int V = 16 / sizeof(T);                                                           \
    T* hp = reinterpret_cast<T*>(h.data_ptr());                                                 \
    const bool vec = plane % V == 0 && aligned_to(hp, 16) && aligned_to(qp, V);                 \
    const int64_t work = vec ? n / V : n;                                                       \
    const int64_t blocks = std::max<int64_t>(                                                   \
        1, std::min<int64_t>((work + threads - 1) / threads, static_cast<int64_t>(sms) * 8));   \
    if (vec)                                                                                    \
      dequant_add_kernel<T, V><<<blocks, threads, 0, stream>>>(hp, qp, sc, st, n, plane);       \
    else                                                                                        \
      dequant_add_kernel<T, 1><<<blocks, threads, 0, stream>>>(hp, qp, sc, st, n, plane);       \
  } while (0)
  switch (h.scalar_type()) {
    case at::kHalf:
      CNA_DQ_LAUNCH(__half);
      break;
    case at::kBFloat16:
      CNA_DQ_LAUNCH(__nv_bfloat16);
      break;
    case at::kFloat:
      CNA_DQ_LAUNCH(float);
      break;
    default:
      TORCH_CHECK(false, "dequant_add_: dtype must be float16, bfloat16 or float32");
  }
#undef CNA_DQ_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dequant_rows: out[r, k] = q[r, k] * scale[r] in out's dtype (fp32 math, one rounding): the
// INT8 weights of the Memory Pool, expanded just before a layer runs. Rows are output channels
// (K = the rest of the weight). Memory-bound: 3 bytes per weight.
// Vector path (K % 16 == 0 and 16-byte aligned pointers: every large SD layer but conv_in): each
// thread loads U 16-byte vectors of int8 first, then converts and stores them (16-byte stores),
// and the grid covers the weight in one pass. The previous version (one vector per step of a
// grid-stride loop over at most 8 blocks per SM, a 64-bit division per vector) ran at 61% of
// the copy rate on the H200: one load in flight per thread and an uneven last round.
template <typename T, int U>
__global__ void dequant_rows_vec_kernel(T* __restrict__ out, const int8_t* __restrict__ q,
                                        const float* __restrict__ scale, uint32_t nv,
                                        uint32_t kv) {
  // nv: 16-element vectors in the weight (< 2^31, checked); kv: vectors per row
  constexpr int V = 16;
  constexpr int W = 16 / sizeof(T);  // elements per 16-byte store
  const uint32_t base = blockIdx.x * blockDim.x * U + threadIdx.x;
  I8Vec<V> a[U];
  float s[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t j = base + u * blockDim.x;
    if (j < nv) {
      a[u] = reinterpret_cast<const I8Vec<V>*>(q)[j];
      s[u] = __ldg(scale + j / kv);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t j = base + u * blockDim.x;
    if (j < nv) {
      AlignedVec<T, W>* ov = reinterpret_cast<AlignedVec<T, W>*>(out + static_cast<size_t>(j) * V);
#pragma unroll
      for (int c = 0; c < V / W; ++c) {
        AlignedVec<T, W> o;
#pragma unroll
        for (int i = 0; i < W; ++i)
          o.v[i] = from_float<T>(static_cast<float>(a[u].v[c * W + i]) * s[u]);
        ov[c] = o;
      }
    }
  }
}

// Scalar path (any K, any alignment): a grid-stride loop, one element per step.
template <typename T>
__global__ void dequant_rows_kernel(T* __restrict__ out, const int8_t* __restrict__ q,
                                    const float* __restrict__ scale, int64_t n, int64_t k) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += stride)
    out[e] = from_float<T>(static_cast<float>(q[e]) * scale[e / k]);
}

void dequant_rows_(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.is_cuda() && scale.is_cuda() && q.device() == scale.device(),
              "dequant_rows_: q and scale must be on one CUDA device");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() >= 1,
              "dequant_rows_: q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == q.size(0),
              "dequant_rows_: scale must be contiguous float32 with one value per row");
  TORCH_CHECK(out.device() == q.device() && out.is_contiguous() && out.sizes() == q.sizes(),
              "dequant_rows_: out must be contiguous, on q's device, with q's shape");
  const at::ScalarType dtype = out.scalar_type();
  const int64_t n = q.numel();
  if (n == 0) return;
  const int64_t k = n / q.size(0);
  const c10::cuda::CUDAGuard guard(q.device());
  const int sms = sm_count();
  const int threads = 256;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sc = scale.data_ptr<float>();
  const bool vec_ok = k % 16 == 0 && n / 16 < (int64_t{1} << 31) && aligned_to(qp, 16);
#define CNA_DR_LAUNCH(T)                                                                        \
  do {                                                                                          \
    T* op = reinterpret_cast<T*>(out.data_ptr());                                               \
    if (vec_ok && aligned_to(op, 16)) {                                                         \
      constexpr int U = 2;                                                                      \
      const uint32_t nv = static_cast<uint32_t>(n / 16);                                        \
      const uint32_t blocks = (nv + threads * U - 1) / (threads * U);                           \
      dequant_rows_vec_kernel<T, U>                                                             \
          <<<blocks, threads, 0, stream>>>(op, qp, sc, nv, static_cast<uint32_t>(k / 16));      \
    } else {                                                                                    \
      const int64_t blocks = std::max<int64_t>(                                                 \
          1, std::min<int64_t>((n + threads - 1) / threads, static_cast<int64_t>(sms) * 8));    \
      dequant_rows_kernel<T><<<blocks, threads, 0, stream>>>(op, qp, sc, n, k);                 \
    }                                                                                           \
  } while (0)
  switch (dtype) {
    case at::kHalf:
      CNA_DR_LAUNCH(__half);
      break;
    case at::kBFloat16:
      CNA_DR_LAUNCH(__nv_bfloat16);
      break;
    case at::kFloat:
      CNA_DR_LAUNCH(float);
      break;
    default:
      TORCH_CHECK(false, "dequant_rows_: dtype must be float16, bfloat16 or float32");
  }
#undef CNA_DR_LAUNCH
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}


// dequant_rows_multi_: several layers' weights expanded by one launch into one flat output,
// segment i at out[off_i, off_i + numel_i), each as dequant_rows would write it. The Memory
// Pool expands a block's layers at once: each launch costs about as much as expanding a
// million weights, and a step launched ~1,400 of them. Vector path only (every segment's K a
// multiple of 16, its int8 weight and its place in out 16-byte aligned; ops.py checks and
// expands one layer at a time otherwise). The segments travel by value (kMaxSegs per launch);
// each block finds its segment among the cumulative block counts.
constexpr int kMaxSegs = 16;

struct DqSegments {
  const int8_t* q[kMaxSegs];
  const float* scale[kMaxSegs];
  uint32_t nv[kMaxSegs];         // 16-element vectors in the segment
  uint32_t kv[kMaxSegs];         // vectors per row
  int64_t out_vec[kMaxSegs];     // where the segment starts in out, in vectors
  uint32_t first_block[kMaxSegs + 1];
  int n;
};

template <typename T, int U>
__global__ void dequant_rows_multi_kernel(T* __restrict__ out, const DqSegments segs) {
  constexpr int V = 16;
  constexpr int W = 16 / sizeof(T);
  int seg = 0;
  while (seg + 1 < segs.n && blockIdx.x >= segs.first_block[seg + 1]) ++seg;
  const int8_t* __restrict__ q = segs.q[seg];
  const float* __restrict__ scale = segs.scale[seg];
  const uint32_t nv = segs.nv[seg];
  const uint32_t kv = segs.kv[seg];
  T* __restrict__ o = out + segs.out_vec[seg] * V;
  const uint32_t base = (blockIdx.x - segs.first_block[seg]) * blockDim.x * U + threadIdx.x;
  I8Vec<V> a[U];
  float s[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t j = base + u * blockDim.x;
    if (j < nv) {
      a[u] = reinterpret_cast<const I8Vec<V>*>(q)[j];
      s[u] = __ldg(scale + j / kv);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint32_t j = base + u * blockDim.x;
    if (j < nv) {
      AlignedVec<T, W>* ov = reinterpret_cast<AlignedVec<T, W>*>(o + static_cast<size_t>(j) * V);
#pragma unroll
      for (int c = 0; c < V / W; ++c) {
        AlignedVec<T, W> v;
#pragma unroll
        for (int i = 0; i < W; ++i)
          v.v[i] = from_float<T>(static_cast<float>(a[u].v[c * W + i]) * s[u]);
        ov[c] = v;
      }
    }
  }
}

void dequant_rows_multi_(const at::Tensor& out, const std::vector<at::Tensor>& qs,
                         const std::vector<at::Tensor>& scales) {
  TORCH_CHECK(qs.size() == scales.size(), "dequant_rows_multi_: one scale per weight");
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 1,
              "dequant_rows_multi_: out must be a contiguous 1-D CUDA tensor");
  const at::ScalarType dtype = out.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "dequant_rows_multi_: dtype must be float16, bfloat16 or float32");
  TORCH_CHECK(aligned_to(out.data_ptr(), 16), "dequant_rows_multi_: out must be 16-byte aligned");
  int64_t total = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    const auto& q = qs[i];
    const auto& sc = scales[i];
    TORCH_CHECK(q.device() == out.device() && sc.device() == out.device(),
                "dequant_rows_multi_: every tensor must be on out's device");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && q.dim() >= 1,
                "dequant_rows_multi_: every weight must be contiguous int8");
    TORCH_CHECK(sc.scalar_type() == at::kFloat && sc.is_contiguous() &&
                    sc.numel() == q.size(0),
                "dequant_rows_multi_: every scale must be contiguous float32, one per row");
    const int64_t n = q.numel();
    TORCH_CHECK(n > 0 && (n / q.size(0)) % 16 == 0 && n / 16 < (int64_t{1} << 31) &&
                    aligned_to(q.data_ptr(), 16),
                "dequant_rows_multi_: every weight needs rows of a multiple of 16, 16-byte "
                "aligned, fewer than 2^35 elements");
    total += n;
  }
  TORCH_CHECK(total == out.numel(), "dequant_rows_multi_: out must hold every weight, in order");
  if (qs.empty()) return;
  const c10::cuda::CUDAGuard guard(out.device());
  auto stream = c10::cuda::getCurrentCUDAStream();
  constexpr int threads = 256;
  constexpr int U = 2;
  int64_t out_vec = 0;
  for (size_t start = 0; start < qs.size(); start += kMaxSegs) {
    DqSegments segs;
    segs.n = static_cast<int>(std::min<size_t>(kMaxSegs, qs.size() - start));
    uint64_t blocks = 0;
    for (int i = 0; i < segs.n; ++i) {
      const auto& q = qs[start + i];
      const int64_t n = q.numel();
      segs.q[i] = q.data_ptr<int8_t>();
      segs.scale[i] = scales[start + i].data_ptr<float>();
      segs.nv[i] = static_cast<uint32_t>(n / 16);
      segs.kv[i] = static_cast<uint32_t>(n / q.size(0) / 16);
      segs.out_vec[i] = out_vec;
      segs.first_block[i] = static_cast<uint32_t>(blocks);
      blocks += (segs.nv[i] + threads * U - 1) / (threads * U);
      out_vec += n / 16;
    }
    TORCH_CHECK(blocks < (uint64_t{1} << 31), "dequant_rows_multi_: too many weights at once");
    segs.first_block[segs.n] = static_cast<uint32_t>(blocks);
    switch (dtype) {
      case at::kHalf:
        dequant_rows_multi_kernel<__half, U><<<static_cast<uint32_t>(blocks), threads, 0, stream>>>(
            reinterpret_cast<__half*>(out.data_ptr()), segs);
        break;
      case at::kBFloat16:
        dequant_rows_multi_kernel<__nv_bfloat16, U>
            <<<static_cast<uint32_t>(blocks), threads, 0, stream>>>(
                reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), segs);
        break;
      default:
        dequant_rows_multi_kernel<float, U><<<static_cast<uint32_t>(blocks), threads, 0, stream>>>(
            out.data_ptr<float>(), segs);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cna
