// Floating kernels the tiny models run under AMP (the CPU build has no bf16 kernels for them):
// activations and their gradients, reductions, softmax, embedding. fp32 inside (norms: kernels_norm.cc).
#include <algorithm>
#include <set>
#include <string>

#include "kernels.h"

namespace xfw_testcpu {

template <typename T, typename F>
void Unary(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out, F f) {
  out->Resize(x.dims());
  const T* px = x.data<T>();
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) p[i] = St<T>(f(Ld(px[i])));  // fp32, or fp64 for double
}

// grad(x or out, dout) -> dx
template <typename T, typename F>
void UnaryGrad(const phi::Context& ctx, const phi::DenseTensor& a, const phi::DenseTensor& dout, phi::DenseTensor* dx, F f) {
  dx->Resize(dout.dims());
  const T* pa = a.data<T>();
  const T* pg = dout.data<T>();
  T* p = ctx.Alloc<T>(dx);
  for (int64_t i = 0, n = dout.numel(); i < n; ++i)
    p[i] = St<T>(f(Ld(pa[i]), Ld(pg[i])));
}

inline float GeluExact(float x) { return 0.5f * x * (1.f + std::erf(x * float(M_SQRT1_2))); }
inline float GeluTanh(float x) {
  return 0.5f * x * (1.f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}
inline float GeluGrad(float x, bool approximate) {
  if (approximate) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    float t = std::tanh(u);
    return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.7978845608028654f * (1.f + 3.f * 0.044715f * x * x);
  }
  return 0.5f * (1.f + std::erf(x * float(M_SQRT1_2))) + x * std::exp(-0.5f * x * x) * 0.3989422804014327f;
}
inline float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

template <typename T>
void GeluKernel(const phi::Context& ctx, const phi::DenseTensor& x, bool approximate, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [&](float v) { return approximate ? GeluTanh(v) : GeluExact(v); });
}
template <typename T>
void GeluGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, bool approximate,
                    phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, x, dout, dx, [&](float v, float g) { return g * GeluGrad(v, approximate); });
}
template <typename T>
void SiluKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](float v) { return v * Sigmoid(v); });
}
template <typename T>
void SiluGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor&, const phi::DenseTensor& dout,
                    phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, x, dout, dx, [](float v, float g) { float s = Sigmoid(v); return g * s * (1.f + v * (1.f - s)); });
}
template <typename T>
void ReluKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return v > 0.f ? v : 0.f; });
}
template <typename T>
void ReluGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return o > 0.f ? g : 0.f; });
}
template <typename T>
void TanhKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return std::tanh(v); });
}
template <typename T>
void TanhGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return g * (1.f - o * o); });
}
template <typename T>
void SigmoidKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](float v) { return Sigmoid(v); });
}
template <typename T>
void SigmoidGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return g * o * (1.f - o); });
}
template <typename T>
void ExpKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return std::exp(v); });
}
template <typename T>
void ExpGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return g * o; });
}
template <typename T>
void SqrtGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return 0.5f * g / o; });
}
template <typename T>
void SqrtKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return std::sqrt(v); });
}
template <typename T>
void RsqrtKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return 1.f / std::sqrt(v); });
}
template <typename T>
void RsqrtGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, out, dout, dx, [](auto o, auto g) { return -0.5f * g * o * o * o; });
}
template <typename T>
void SquareKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  Unary<T>(ctx, x, out, [](auto v) { return v * v; });
}
template <typename T>
void SquareGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, phi::DenseTensor* dx) { XFW_HIT();
  UnaryGrad<T>(ctx, x, dout, dx, [](auto v, auto g) { return 2.f * v * g; });
}
template <typename T>
void PowKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& factor, phi::DenseTensor* out) { XFW_HIT();
  float f = static_cast<float>(factor.to<double>());
  Unary<T>(ctx, x, out, [f](float v) { return f == 2.f ? v * v : std::pow(v, f); });
}
template <typename T>
void PowGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::Scalar& factor,
                   phi::DenseTensor* dx) { XFW_HIT();
  float f = static_cast<float>(factor.to<double>());
  UnaryGrad<T>(ctx, x, dout, dx, [f](float v, float g) { return g * f * (f == 2.f ? v : std::pow(v, f - 1.f)); });
}

// ---- reductions over a set of axes ------------------------------------------------------------------
struct Reduction {
  Dims in, out_keep;           // out_keep: the input's dims with every reduced axis set to 1
  std::set<int64_t> reduced;   // reduced axes, non-negative
  int64_t count = 1;           // input elements reduced into each output element
  Reduction(const Dims& d, const std::vector<int64_t>& axes, bool reduce_all) : in(d), out_keep(d) {
    int64_t r = static_cast<int64_t>(d.size());
    if (reduce_all || axes.empty()) for (int64_t i = 0; i < r; ++i) reduced.insert(i);
    for (auto a : axes) if ((a < 0 ? a + r : a) < r) reduced.insert(a < 0 ? a + r : a);
    for (auto a : reduced) { count *= d[a]; out_keep[a] = 1; }
  }
  Dims OutDims(bool keep_dim) const {
    if (keep_dim) return out_keep;
    Dims o;
    for (size_t i = 0; i < in.size(); ++i) if (!reduced.count(static_cast<int64_t>(i))) o.push_back(in[i]);
    return o;
  }
  template <typename F>
  void Each(F f) const {  // f(input index, output index): out_keep broadcast to the input maps one to the other
    Broadcast b(in, out_keep);
    b.Each([&](int64_t i, int64_t, int64_t io) { f(i, io); });
  }
};

Reduction MakeReduction(const Dims& d, const std::vector<int64_t>& axes, bool reduce_all) {
  return Reduction(d, axes, reduce_all);
}

template <typename T>
void SumMean(const phi::Context& ctx, const phi::DenseTensor& x, const std::vector<int64_t>& axes, bool keep_dim,
             bool mean, phi::DenseTensor* out) {
  Reduction r = MakeReduction(x.dims(), axes, false);
  std::vector<double> acc(Numel(r.out_keep), 0.0);
  const T* px = x.data<T>();
  r.Each([&](int64_t i, int64_t o) { acc[o] += static_cast<double>(Ld(px[i])); });
  out->Resize(r.OutDims(keep_dim));
  T* p = ctx.Alloc<T>(out);
  for (size_t i = 0; i < acc.size(); ++i) p[i] = St<T>(static_cast<C<T>>(mean ? acc[i] / r.count : acc[i]));
}

template <typename T>
void SumKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::IntArray& dims, PD_DataType out_dtype,
               bool keep_dim, phi::DenseTensor* out) { XFW_HIT();
  PD_CHECK(out_dtype == PD_DataType::UNDEFINED || out_dtype == x.dtype(),
           "xfw testcpu: sum with a different output dtype is not implemented");
  SumMean<T>(ctx, x, dims.GetData(), keep_dim, false, out);
}
template <typename T>
void MeanKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::IntArray& dims, bool keep_dim,
                phi::DenseTensor* out) { XFW_HIT();
  SumMean<T>(ctx, x, dims.GetData(), keep_dim, true, out);
}
template <typename T>
void SumMeanGrad(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout,
                 const std::vector<int64_t>& axes, bool reduce_all, bool mean, phi::DenseTensor* dx) {
  Reduction r = MakeReduction(x.dims(), axes, reduce_all);
  const T* pg = dout.data<T>();
  dx->Resize(x.dims());
  T* p = ctx.Alloc<T>(dx);
  r.Each([&](int64_t i, int64_t o) {
    float g = static_cast<float>(Ld(pg[o]));
    p[i] = St<T>(static_cast<C<T>>(mean ? g / r.count : g));
  });
}
template <typename T>
void SumGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::IntArray& dims,
                   bool, bool reduce_all, phi::DenseTensor* dx) { XFW_HIT();
  SumMeanGrad<T>(ctx, x, dout, dims.GetData(), reduce_all, false, dx);
}
template <typename T>
void MeanGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::IntArray& dims,
                    bool, bool reduce_all, phi::DenseTensor* dx) { XFW_HIT();
  SumMeanGrad<T>(ctx, x, dout, dims.GetData(), reduce_all, true, dx);
}

// ---- softmax over an axis -----------------------------------------------------------------
inline void Rows(const Dims& d, int axis, int64_t* outer, int64_t* len, int64_t* inner) {
  int r = static_cast<int>(d.size());
  if (axis < 0) axis += r;
  *outer = 1; *inner = 1; *len = r ? d[axis] : 1;
  for (int i = 0; i < axis; ++i) *outer *= d[i];
  for (int i = axis + 1; i < r; ++i) *inner *= d[i];
}

template <typename T>
void SoftmaxKernel(const phi::Context& ctx, const phi::DenseTensor& x, int axis, phi::DenseTensor* out) { XFW_HIT();
  int64_t outer, len, inner;
  Rows(x.dims(), axis, &outer, &len, &inner);
  std::vector<float> v = ToF32(x);
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t in = 0; in < inner; ++in) {
      float mx = -INFINITY, s = 0.f;
      for (int64_t k = 0; k < len; ++k) mx = std::max(mx, v[(o * len + k) * inner + in]);
      for (int64_t k = 0; k < len; ++k) { float& e = v[(o * len + k) * inner + in]; e = std::exp(e - mx); s += e; }
      for (int64_t k = 0; k < len; ++k) v[(o * len + k) * inner + in] /= s;
    }
  out->Resize(x.dims());
  out->set_dtype(x.dtype());
  StoreF32(ctx, out, v.data(), static_cast<int64_t>(v.size()));
}
template <typename T>
void SoftmaxGradKernel(const phi::Context& ctx, const phi::DenseTensor& out, const phi::DenseTensor& dout, int axis,
                       phi::DenseTensor* dx) { XFW_HIT();
  int64_t outer, len, inner;
  Rows(out.dims(), axis, &outer, &len, &inner);
  std::vector<float> y = ToF32(out), g = ToF32(dout), d(y.size());
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t in = 0; in < inner; ++in) {
      float dot = 0.f;
      for (int64_t k = 0; k < len; ++k) { int64_t i = (o * len + k) * inner + in; dot += y[i] * g[i]; }
      for (int64_t k = 0; k < len; ++k) { int64_t i = (o * len + k) * inner + in; d[i] = y[i] * (g[i] - dot); }
    }
  dx->Resize(out.dims());
  dx->set_dtype(out.dtype());
  StoreF32(ctx, dx, d.data(), static_cast<int64_t>(d.size()));
}

// ---- embedding -------------------------------------------------------------------------------------
template <typename T>
void EmbeddingKernel(const phi::Context& ctx, const phi::DenseTensor& ids, const phi::DenseTensor& weight, int64_t padding_idx,
                     phi::DenseTensor* out) { XFW_HIT();
  Dims wd = weight.dims(), od = ids.dims();
  int64_t dim = wd[1], n = ids.numel();
  od.push_back(dim);
  out->Resize(od);
  const T* w = weight.data<T>();
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = ids.dtype() == PD_DataType::INT64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
    for (int64_t c = 0; c < dim; ++c) p[i * dim + c] = id == padding_idx ? St<T>(0.f) : w[id * dim + c];
  }
}
template <typename T>
void EmbeddingGradKernel(const phi::Context& ctx, const phi::DenseTensor& ids, const phi::DenseTensor& weight,
                         const phi::DenseTensor& dout, int64_t padding_idx, phi::DenseTensor* dw) { XFW_HIT();
  Dims wd = weight.dims();
  int64_t dim = wd[1], n = ids.numel();
  std::vector<float> g = ToF32(dout), acc(weight.numel(), 0.f);
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = ids.dtype() == PD_DataType::INT64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
    if (id == padding_idx) continue;
    for (int64_t c = 0; c < dim; ++c) acc[id * dim + c] += g[i * dim + c];
  }
  dw->Resize(wd);
  dw->set_dtype(weight.dtype());
  StoreF32(ctx, dw, acc.data(), static_cast<int64_t>(acc.size()));
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(gelu, testcpu, ALL_LAYOUT, GeluKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(gelu_grad, testcpu, ALL_LAYOUT, GeluGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(silu, testcpu, ALL_LAYOUT, SiluKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(silu_grad, testcpu, ALL_LAYOUT, SiluGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(relu, testcpu, ALL_LAYOUT, ReluKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(relu_grad, testcpu, ALL_LAYOUT, ReluGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(tanh, testcpu, ALL_LAYOUT, TanhKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(tanh_grad, testcpu, ALL_LAYOUT, TanhGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sigmoid, testcpu, ALL_LAYOUT, SigmoidKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sigmoid_grad, testcpu, ALL_LAYOUT, SigmoidGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(exp, testcpu, ALL_LAYOUT, ExpKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(exp_grad, testcpu, ALL_LAYOUT, ExpGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sqrt_grad, testcpu, ALL_LAYOUT, SqrtGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sqrt, testcpu, ALL_LAYOUT, SqrtKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(rsqrt, testcpu, ALL_LAYOUT, RsqrtKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(rsqrt_grad, testcpu, ALL_LAYOUT, RsqrtGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(square, testcpu, ALL_LAYOUT, SquareKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(square_grad, testcpu, ALL_LAYOUT, SquareGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(pow, testcpu, ALL_LAYOUT, PowKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(pow_grad, testcpu, ALL_LAYOUT, PowGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sum, testcpu, ALL_LAYOUT, SumKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(mean, testcpu, ALL_LAYOUT, MeanKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(sum_grad, testcpu, ALL_LAYOUT, SumGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(mean_grad, testcpu, ALL_LAYOUT, MeanGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(softmax, testcpu, ALL_LAYOUT, SoftmaxKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(softmax_grad, testcpu, ALL_LAYOUT, SoftmaxGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(embedding, testcpu, ALL_LAYOUT, EmbeddingKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(embedding_grad, testcpu, ALL_LAYOUT, EmbeddingGradKernel, XFW_FLOATS) {}
