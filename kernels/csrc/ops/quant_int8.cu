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
// = element / HW. Both memory-bound. Strength is a device scalar (no recapture on change).

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../common.cuh"

namespace cna {

constexpr int kQThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kQThreads)
    quantize_kernel(const T* __restrict__ x, int8_t* __restrict__ q, float* __restrict__ scale,
                    int64_t plane) {
  const int64_t p = blockIdx.x;
  const T* xp = x + p * plane;
  int8_t* qp = q + p * plane;
  float m = 0.f;
  for (int64_t j = threadIdx.x; j < plane; j += blockDim.x) m = fmaxf(m, fabsf(to_float(xp[j])));
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
  for (int64_t j = threadIdx.x; j < plane; j += blockDim.x) {
    float v = rintf(to_float(xp[j]) * inv);  // round half to even, as torch.round
    v = fminf(fmaxf(v, -127.f), 127.f);
    qp[j] = static_cast<int8_t>(v);
  }
}

template <typename T>
__global__ void dequant_add_kernel(T* __restrict__ h, const int8_t* __restrict__ q,
                                   const float* __restrict__ scale,
                                   const float* __restrict__ strength, int64_t n, int64_t plane) {
  const float s = strength[0];
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; j < n;
       j += stride) {
    const float f = s * scale[j / plane];
    h[j] = from_float<T>(to_float(h[j]) + f * static_cast<float>(q[j]));
  }
}

std::vector<torch::Tensor> quantize_int8(const torch::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "quantize_int8: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() >= 2, "quantize_int8: x must be (B, C, ...), got ", x.sizes());
  TORCH_CHECK(x.is_contiguous(), "quantize_int8: x must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());
  auto q = torch::empty(x.sizes(), x.options().dtype(torch::kInt8));
  auto scale = torch::empty({x.size(0), x.size(1)}, x.options().dtype(torch::kFloat));
  const int64_t planes = x.size(0) * x.size(1);
  if (planes == 0) return {q, scale};
  const int64_t plane = x.numel() / planes;
  auto stream = c10::cuda::getCurrentCUDAStream();
  switch (x.scalar_type()) {
    case at::kHalf:
      quantize_kernel<__half><<<planes, kQThreads, 0, stream>>>(
          reinterpret_cast<const __half*>(x.data_ptr()), q.data_ptr<int8_t>(),
          scale.data_ptr<float>(), plane);
      break;
    case at::kBFloat16:
      quantize_kernel<__nv_bfloat16><<<planes, kQThreads, 0, stream>>>(
          reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), q.data_ptr<int8_t>(),
          scale.data_ptr<float>(), plane);
      break;
    case at::kFloat:
      quantize_kernel<float><<<planes, kQThreads, 0, stream>>>(
          x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), plane);
      break;
    default:
      TORCH_CHECK(false, "quantize_int8: dtype must be float16, bfloat16 or float32, got ",
                  x.scalar_type());
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {q, scale};
}

void dequant_add_(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& scale,
                  const torch::Tensor& strength) {
  TORCH_CHECK(h.is_cuda() && q.is_cuda() && scale.is_cuda() && strength.is_cuda(),
              "dequant_add_: all tensors must be on CUDA");
  TORCH_CHECK(h.device() == q.device() && h.device() == scale.device() &&
                  h.device() == strength.device(),
              "dequant_add_: all tensors must be on one device");
  TORCH_CHECK(h.is_contiguous() && q.is_contiguous() && scale.is_contiguous(),
              "dequant_add_: h, q and scale must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.sizes() == h.sizes(),
              "dequant_add_: q must be int8 with h's shape");
  TORCH_CHECK(h.dim() >= 2 && scale.scalar_type() == torch::kFloat &&
                  scale.numel() == h.size(0) * h.size(1),
              "dequant_add_: scale must be float32 (B, C)");
  TORCH_CHECK(strength.scalar_type() == torch::kFloat && strength.numel() == 1,
              "dequant_add_: strength must be a float32 scalar tensor");
  const int64_t n = h.numel();
  if (n == 0) return;
  const int64_t plane = n / (h.size(0) * h.size(1));
  const c10::cuda::CUDAGuard guard(h.device());
  const int sms = sm_count();
  const int threads = 256;
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>((n + threads - 1) / threads, static_cast<int64_t>(sms) * 8));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const float* sc = scale.data_ptr<float>();
  const float* st = strength.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  switch (h.scalar_type()) {
    case at::kHalf:
      dequant_add_kernel<__half><<<blocks, threads, 0, stream>>>(
          reinterpret_cast<__half*>(h.data_ptr()), qp, sc, st, n, plane);
      break;
    case at::kBFloat16:
      dequant_add_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(
          reinterpret_cast<__nv_bfloat16*>(h.data_ptr()), qp, sc, st, n, plane);
      break;
    case at::kFloat:
      dequant_add_kernel<float><<<blocks, threads, 0, stream>>>(h.data_ptr<float>(), qp, sc, st,
                                                                 n, plane);
      break;
    default:
      TORCH_CHECK(false, "dequant_add_: dtype must be float16, bfloat16 or float32");
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cna
