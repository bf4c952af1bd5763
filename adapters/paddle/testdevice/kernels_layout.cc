// Stride kernels: Paddle's view machinery calls contiguous (a strided view into a dense tensor) and
// strided_copy (a dense tensor into a strided view of a larger buffer) on the device for every dtype;
// without them a bf16 view cannot be materialised at all, and a strided write would not land in place.
#include "kernels.h"

namespace xfw_testcpu {
namespace {

// Element offset of the i-th element (row-major over dims) under the given strides.
inline int64_t Offset(int64_t i, const Dims& dims, const Dims& strides) {
  int64_t off = 0;
  for (int d = static_cast<int>(dims.size()) - 1; d >= 0; --d) {
    off += (i % dims[d]) * strides[d];
    i /= dims[d];
  }
  return off;
}

inline Dims Dense(const Dims& dims) {
  Dims s(dims.size(), 1);
  for (int d = static_cast<int>(dims.size()) - 2; d >= 0; --d) s[d] = s[d + 1] * dims[d + 1];
  return s;
}

}  // namespace

template <typename T>
void ContiguousKernel(const phi::Context& ctx, const phi::DenseTensor& input, phi::DenseTensor* out) { XFW_HIT();
  Dims dims = input.dims(), strides = input.strides();
  if (strides.size() != dims.size()) strides = Dense(dims);
  const T* src = input.data<T>();
  out->Resize(dims);
  out->set_strides(Dense(dims));
  out->set_offset(0);
  T* dst = ctx.Alloc<T>(out);
  for (int64_t i = 0, n = Numel(dims); i < n; ++i) dst[i] = src[Offset(i, dims, strides)];
}

template <typename T>
void StridedCopyKernel(const phi::Context& ctx, const phi::DenseTensor& input, const std::vector<int64_t>& dims,
                       const std::vector<int64_t>& out_strides, int64_t offset, phi::DenseTensor* out) { XFW_HIT();
  Dims in_dims = input.dims(), in_strides = input.strides();
  if (in_strides.size() != in_dims.size()) in_strides = Dense(in_dims);
  PD_CHECK(Numel(in_dims) == Numel(dims), "xfw testcpu strided_copy: %d elements into %d",
           int(Numel(in_dims)), int(Numel(dims)));
  out->Resize(dims);
  out->set_strides(out_strides);
  out->set_offset(offset);
  const T* src = input.data<T>();
  T* dst = out->data<T>();
  PD_CHECK(dst != nullptr, "xfw testcpu strided_copy: the output has no memory");
  for (int64_t i = 0, n = Numel(dims); i < n; ++i) dst[Offset(i, dims, out_strides)] = src[Offset(i, in_dims, in_strides)];
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(contiguous, testcpu, ALL_LAYOUT, ContiguousKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(strided_copy, testcpu, ALL_LAYOUT, StridedCopyKernel, XFW_ALL) {}
