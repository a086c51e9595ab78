// SPDX-License-Identifier: GPL-3.0-or-later
//
// graph_if_begin / graph_if_end: record an IF node in the CUDA graph being captured on the
// current stream. Work issued between the two calls lands in the node's body graph, which runs
// at a replay only when the one-element bool tensor `pred` is true at that point of the replay.
// PyTorch records IF nodes itself from 2.12 (CUDAGraph.begin_capture_to_if_node); this is the
// same sequence of CUDA runtime calls (CUDA 12.4+), for the torch releases without it.
//
// begin:
//   1. a conditional handle on the captured graph, set at every replay by a one-thread kernel
//      that reads `pred` (captured on the current stream, so it runs after whatever wrote it);
//   2. the conditional node, after that kernel; the current stream's capture then continues
//      after the node;
//   3. the body is captured from a dedicated side stream (one per device and nesting depth, kept
//      for the process so that its cuBLAS workspace is made once), which becomes the current
//      stream;
//   4. PyTorch's caching allocator serves that stream from the graph's memory pool (`pool`, the
//      pool the graph was begun with), as it serves the graph's own capture.
// end: ends the body's capture, gives the pool back to the graph's own capture, and makes the
// graph's stream current again.
//
// The body must not allocate under cudaMallocAsync (a conditional body cannot hold memory
// allocation nodes) nor synchronise. Begin/end pairs nest (a stack per thread).

#include <ATen/core/Tensor.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "../common.cuh"

namespace cna {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12040

namespace {

__global__ void set_if_handle_kernel(cudaGraphConditionalHandle handle, const bool* pred) {
  cudaGraphSetConditional(handle, *pred ? 1u : 0u);
}

struct OpenIf {
  c10::cuda::CUDAStream parent;
  c10::cuda::CUDAStream body;
  c10::DeviceIndex device;
  c10::cuda::MempoolId_t pool;
  unsigned long long parent_capture;
};

thread_local std::vector<OpenIf> open_ifs;

// The allocator's filter: streams capturing for this capture id draw from the pool.
std::function<bool(cudaStream_t)> capturing_for(unsigned long long id) {
  return [id](cudaStream_t s) {
    cudaStreamCaptureStatus status{};
    unsigned long long sid = 0;
    if (cudaStreamGetCaptureInfo(s, &status, &sid) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return status == cudaStreamCaptureStatusActive && sid == id;
  };
}

// A nested IF node's body is captured while its parent's body still is: one stream per depth.
c10::cuda::CUDAStream body_stream(c10::DeviceIndex device, size_t depth) {
  static std::map<std::pair<c10::DeviceIndex, size_t>, c10::cuda::CUDAStream> streams;
  static std::mutex lock;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_pair(device, depth);
  auto it = streams.find(key);
  if (it == streams.end()) {
    it = streams.emplace(key, c10::cuda::getStreamFromPool(false, device)).first;
  }
  return it->second;
}

}  // namespace

bool graph_if_supported() { return true; }

void graph_if_warm(int64_t device_index) {
  // cuBLAS gets its workspace at its first use on a stream, through the allocator: under
  // cudaMallocAsync that would be an allocation node inside the body, which CUDA refuses. So
  // each body stream (depths 0 and 1) runs one matrix multiply here, outside any capture.
  static std::mutex lock;
  static std::vector<c10::DeviceIndex> warm;
  const auto device = static_cast<c10::DeviceIndex>(device_index);
  std::lock_guard<std::mutex> guard(lock);
  for (auto d : warm) {
    if (d == device) return;
  }
  const auto opts = at::TensorOptions().device(at::kCUDA, device).dtype(at::kHalf);
  for (size_t depth = 0; depth < 2; ++depth) {
    c10::cuda::CUDAStreamGuard on_body(body_stream(device, depth));
    auto a = at::ones({16, 16}, opts);
    at::mm(a, a);
    at::mm(a.to(at::kFloat), a.to(at::kFloat));
    C10_CUDA_CHECK(cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(device).stream()));
  }
  warm.push_back(device);
}

void graph_if_begin(const at::Tensor& pred, int64_t pool_a, int64_t pool_b) {
  CNA_CHECK(pred.is_cuda() && pred.scalar_type() == at::kBool && pred.numel() == 1,
            "graph_if_begin: pred must be a one-element bool CUDA tensor");
  const c10::DeviceIndex device = pred.get_device();
  auto parent = c10::cuda::getCurrentCUDAStream(device);
  cudaStreamCaptureStatus status{};
  unsigned long long parent_capture = 0;
  cudaGraph_t graph{};
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(parent.stream(), &status, &parent_capture, &graph));
  CNA_CHECK(status == cudaStreamCaptureStatusActive,
            "graph_if_begin: the current stream is not capturing a CUDA graph");

  cudaGraphConditionalHandle handle{};
  C10_CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, 0));
  set_if_handle_kernel<<<1, 1, 0, parent.stream()>>>(handle, pred.data_ptr<bool>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n_deps = 0;
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(parent.stream(), &status, nullptr, &graph, &deps,
                                          &edges, &n_deps));
#else
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo_v3(parent.stream(), &status, nullptr, &graph, &deps,
                                             &edges, &n_deps));
#endif
  cudaGraphNodeParams params{};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node{};
#if CUDART_VERSION >= 13000
  C10_CUDA_CHECK(cudaGraphAddNode(&node, graph, deps, edges, n_deps, &params));
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies(parent.stream(), &node, nullptr, 1,
                                                     cudaStreamSetCaptureDependencies));
#else
  C10_CUDA_CHECK(cudaGraphAddNode_v2(&node, graph, deps, edges, n_deps, &params));
  C10_CUDA_CHECK(cudaStreamUpdateCaptureDependencies_v2(parent.stream(), &node, nullptr, 1,
                                                        cudaStreamSetCaptureDependencies));
#endif
  cudaGraph_t body_graph = params.conditional.phGraph_out[0];

  auto body = body_stream(device, open_ifs.size());
  C10_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body.stream(), body_graph, nullptr, nullptr, 0,
                                               cudaStreamCaptureModeThreadLocal));
  unsigned long long body_capture = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(body.stream(), &status, &body_capture));
  const c10::cuda::MempoolId_t pool{static_cast<c10::cuda::CaptureId_t>(pool_a),
                                    static_cast<c10::cuda::CaptureId_t>(pool_b)};
  c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(device, pool, capturing_for(body_capture));
  open_ifs.push_back(OpenIf{parent, body, device, pool, parent_capture});
  c10::cuda::setCurrentCUDAStream(body);
}

void graph_if_end() {
  CNA_CHECK(!open_ifs.empty(), "graph_if_end: no IF node is open");
  OpenIf open = open_ifs.back();
  open_ifs.pop_back();
  c10::cuda::setCurrentCUDAStream(open.parent);
  C10_CUDA_CHECK(cudaStreamEndCapture(open.body.stream(), nullptr));
  c10::cuda::CUDACachingAllocator::endAllocateToPool(open.device, open.pool);
  c10::cuda::CUDACachingAllocator::beginAllocateToPool(open.device, open.pool,
                                                       capturing_for(open.parent_capture));
}

#else  // CUDA older than 12.4: no conditional nodes

bool graph_if_supported() { return false; }

void graph_if_warm(int64_t) {}

void graph_if_begin(const at::Tensor&, int64_t, int64_t) {
  CNA_CHECK(false, "graph_if_begin: CUDA graph IF nodes need CUDA 12.4 or newer");
}

void graph_if_end() { CNA_CHECK(false, "graph_if_end: CUDA graph IF nodes need CUDA 12.4"); }

#endif

}  // namespace cna
