// SPDX-License-Identifier: GPL-3.0-or-later
// The one extension module: every op family's entry points, registered here.
#include <torch/extension.h>

#include <vector>

namespace cna {
std::vector<torch::Tensor> control_merge(const std::vector<torch::Tensor>& residuals,
                                         const torch::Tensor& strengths, int64_t num_nets);
void control_merge_add_(const std::vector<torch::Tensor>& hidden,
                        const std::vector<torch::Tensor>& residuals,
                        const torch::Tensor& strengths);
std::vector<torch::Tensor> quantize_int8(const torch::Tensor& x);
void dequant_add_(const torch::Tensor& h, const torch::Tensor& q, const torch::Tensor& scale,
                  const torch::Tensor& strength);
void dequant_rows_(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& scale);
void dequant_rows_multi_(const torch::Tensor& out, const std::vector<torch::Tensor>& qs,
                         const std::vector<torch::Tensor>& scales);
torch::Tensor group_norm_silu(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, int64_t groups, double eps);
bool graph_if_supported();
void graph_if_begin(const torch::Tensor& pred, int64_t pool_a, int64_t pool_b);
void graph_if_end();
void graph_if_warm(int64_t device);
}  // namespace cna

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ControlNet Accelerator CUDA kernels";
  m.def("control_merge", &cna::control_merge, "out[k] = sum_i s[i] * r[i][k], all slots at once");
  m.def("control_merge_add_", &cna::control_merge_add_, "hidden[k] += sum_i s[i] * r[i][k]");
  m.def("quantize_int8", &cna::quantize_int8, "per-(sample, channel) symmetric INT8");
  m.def("dequant_add_", &cna::dequant_add_, "h += strength * q * scale[b, c]");
  m.def("dequant_rows_", &cna::dequant_rows_, "out[r, k] = q[r, k] * scale[r]");
  m.def("dequant_rows_multi_", &cna::dequant_rows_multi_,
        "dequant_rows_ of several weights into one flat out, one launch");
  m.def("group_norm_silu", &cna::group_norm_silu, "SiLU(GroupNorm(x))");
  m.def("graph_if_supported", &cna::graph_if_supported, "built with CUDA graph IF nodes (12.4+)");
  m.def("graph_if_begin", &cna::graph_if_begin,
        "capture what follows into an IF node of the graph being captured, run when pred");
  m.def("graph_if_end", &cna::graph_if_end, "close the IF node graph_if_begin opened");
  m.def("graph_if_warm", &cna::graph_if_warm,
        "give the IF bodies' streams their cuBLAS workspace, outside any capture");
}
