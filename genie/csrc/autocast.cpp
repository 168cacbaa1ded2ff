// Autocast for the remote_accelerator (PrivateUse1) device: torch.autocast("remote_accelerator").
//
// PyTorch registers autocast kernels for its own backends only; a PrivateUse1
// backend registers its own, or every op inside an autocast region fails with
// "Could not run 'aten::linear' with arguments from the 'Autocast...' backend".
// These are PyTorch's op lists and casting policies (ATen/autocast_mode.h, as
// AutocastCUDA uses them): matmuls and convolutions in the lower precision,
// reductions, norms and losses in float32, mixed inputs promoted, everything
// else falls through. The casts themselves are ops on remote tensors, captured
// and run by the daemon like any other.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace {
using namespace at::autocast;
// The signatures in AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE name these unqualified.
#if defined(GENIE_TORCH_VERSION) && GENIE_TORCH_VERSION < 213
using at::DimnameList;  // named-tensor signatures, still in torch 2.11's lists
#endif
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define GENIE_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(GENIE_LOWER_PRECISION)
#define GENIE_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(GENIE_FP32)
#define GENIE_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(GENIE_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define GENIE_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(GENIE_PROMOTE)
  // torch.sparse.mm(sparse, dense): on CPU and CUDA its kernel calls addmm, which autocast casts;
  // Genie's sparse tensors take _sparse_addmm whole, below autocast, so it is listed itself.
  KERNEL_PRIVATEUSEONE(_sparse_addmm, lower_precision_fp)
}

}  // namespace

// Something for ctypes to find: loading the library is what registers the kernels above.
extern "C" int genie_autocast_loaded() { return 1; }
