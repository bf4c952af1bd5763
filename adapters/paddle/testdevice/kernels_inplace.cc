// Kernels for the ops ZeRO sharding applies in place to views of its flat buffers (scale_, fill_/zero_,
// full_, assign/copy, cast, add_/subtract_/multiply_/divide_, adamw_/adam_) plus the elementwise family
// they belong to. Without a native kernel Paddle runs its CPU kernel on a copy and the view never sees
// the result: the run trains, and is wrong. tests/contract/test_testdevice.py checks each on a view.
#include <tuple>

#include "kernels.h"

namespace xfw_testcpu {

template <typename T>
void FullKernel(const phi::Context& ctx, const phi::IntArray& shape, const phi::Scalar& val, PD_DataType,
                phi::DenseTensor* out) { XFW_HIT();
  out->Resize(shape.GetData());
  T* p = ctx.Alloc<T>(out);
  T v = St<T>(val.to<double>());
  for (int64_t i = 0, n = out->numel(); i < n; ++i) p[i] = v;
}

template <typename T>
void FullLikeKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& val, PD_DataType,
                    phi::DenseTensor* out) { XFW_HIT();
  out->Resize(x.dims());
  T* p = ctx.Alloc<T>(out);
  T v = St<T>(val.to<double>());
  for (int64_t i = 0, n = out->numel(); i < n; ++i) p[i] = v;
}

template <typename T>
void FillKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& val, phi::DenseTensor* out) { XFW_HIT();
  T* p = ctx.Alloc<T>(out);
  T v = St<T>(val.to<double>());
  for (int64_t i = 0, n = out->numel(); i < n; ++i) p[i] = v;
}

template <typename T>
void AssignKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  out->Resize(x.dims());
  T* p = ctx.Alloc<T>(out);
  const T* s = x.data<T>();
  if (p != s) std::memmove(p, s, sizeof(T) * x.numel());
}

template <typename T, typename O>
void CastTo(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) {
  O* p = ctx.Alloc<O>(out);
  const T* s = x.data<T>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) p[i] = St<O>(Ld(s[i]));
}

template <typename T>
void CastKernel(const phi::Context& ctx, const phi::DenseTensor& x, PD_DataType dtype, phi::DenseTensor* out) { XFW_HIT();
  out->Resize(x.dims());
  switch (dtype) {
    case PD_DataType::FLOAT32: return CastTo<T, float>(ctx, x, out);
    case PD_DataType::FLOAT64: return CastTo<T, double>(ctx, x, out);
    case PD_DataType::FLOAT16: return CastTo<T, float16>(ctx, x, out);
    case PD_DataType::BFLOAT16: return CastTo<T, bfloat16>(ctx, x, out);
    case PD_DataType::INT32: return CastTo<T, int32_t>(ctx, x, out);
    case PD_DataType::INT64: return CastTo<T, int64_t>(ctx, x, out);
    case PD_DataType::INT16: return CastTo<T, int16_t>(ctx, x, out);
    case PD_DataType::INT8: return CastTo<T, int8_t>(ctx, x, out);
    case PD_DataType::UINT8: return CastTo<T, uint8_t>(ctx, x, out);
    case PD_DataType::BOOL: return CastTo<T, bool>(ctx, x, out);
    default: PD_CHECK(false, "xfw testcpu: cast to dtype %d is not implemented", int(dtype));
  }
}

template <typename T>
void ScaleKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& scale,
                 const phi::Scalar& bias, bool bias_after_scale, phi::DenseTensor* out) { XFW_HIT();
  out->Resize(x.dims());
  using A = C<T>;
  A s = static_cast<A>(scale.to<double>()), b = static_cast<A>(bias.to<double>());
  const T* px = x.data<T>();
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    A v = Ld(px[i]);
    p[i] = St<T>(bias_after_scale ? v * s + b : (v + b) * s);
  }
}

template <typename T>
void DivScaleKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& scale, phi::DenseTensor* out) { XFW_HIT();
  out->Resize(x.dims());
  using A = C<T>;
  A s = static_cast<A>(scale.to<double>());
  const T* px = x.data<T>();
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) p[i] = St<T>(Ld(px[i]) / s);
}

template <typename T, typename F>
void Binary(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y, phi::DenseTensor* out, F f) {
  Broadcast b(x.dims(), y.dims());
  out->Resize(b.out);
  const T* px = x.data<T>();
  const T* py = y.data<T>();
  T* p = ctx.Alloc<T>(out);
  b.Each([&](int64_t i, int64_t ix, int64_t iy) { p[i] = St<T>(f(Ld(px[ix]), Ld(py[iy]))); });
}

#define XFW_BINARY(Name, expr)                                                                        \
  template <typename T>                                                                               \
  void Name##Kernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,    \
                    phi::DenseTensor* out) { XFW_HIT();                                               \
    Binary<T>(ctx, x, y, out, [](C<T> a, C<T> b) { return expr; });                                   \
  }
XFW_BINARY(Add, a + b)
XFW_BINARY(Subtract, a - b)
XFW_BINARY(Multiply, a * b)
XFW_BINARY(Divide, a / b)
XFW_BINARY(Maximum, a > b ? a : b)
XFW_BINARY(Minimum, a < b ? a : b)

// d(out)/d(x) reduced over x's broadcast dimensions: acc[ix] += g(dout, x, y), in fp32 (fp64 for double).
template <typename T, typename G>
std::vector<C<T>> GradAcc(const phi::DenseTensor& x, const phi::DenseTensor& y, const phi::DenseTensor& dout,
                          bool for_x, const phi::DenseTensor* d, G g, bool reads_inputs) {
  // add_grad/subtract_grad get x and y without their buffers (Paddle's no_need_buffer): only shapes.
  if (!d) return {};
  Broadcast b(x.dims(), y.dims());
  const T* px = reads_inputs ? x.data<T>() : nullptr;
  const T* py = reads_inputs ? y.data<T>() : nullptr;
  static const T zero{};
  const T* pg = dout.data<T>();
  std::vector<C<T>> acc((for_x ? x : y).numel(), 0);
  b.Each([&](int64_t i, int64_t ix, int64_t iy) {
    acc[for_x ? ix : iy] += g(Ld(pg[i]), Ld(px ? px[ix] : zero), Ld(py ? py[iy] : zero));
  });
  return acc;
}

// Both gradients are accumulated before either is stored: Paddle may hand out dx in dout's own memory
// (add_grad's and subtract_grad's inplace out_grad -> x_grad), so storing dx first would change the dout
// that dy is still to read (a broadcast x, the smaller one, overwrote dout's first elements).
template <typename T, typename GX, typename GY>
void BinaryGrad(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                const phi::DenseTensor& dout, phi::DenseTensor* dx, phi::DenseTensor* dy, GX gx, GY gy,
                bool reads_inputs = false) {
  std::vector<C<T>> ax = GradAcc<T>(x, y, dout, true, dx, gx, reads_inputs);
  std::vector<C<T>> ay = GradAcc<T>(x, y, dout, false, dy, gy, reads_inputs);
  for (auto [d, self, acc] : {std::make_tuple(dx, &x, &ax), std::make_tuple(dy, &y, &ay)}) {
    if (!d) continue;
    d->Resize(self->dims());
    T* p = ctx.Alloc<T>(d);
    for (size_t i = 0; i < acc->size(); ++i) p[i] = St<T>((*acc)[i]);
  }
}

template <typename T>
void AddGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                   const phi::DenseTensor& dout, int, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  BinaryGrad<T>(ctx, x, y, dout, dx, dy, [](C<T> g, C<T>, C<T>) { return g; }, [](C<T> g, C<T>, C<T>) { return g; });
}

template <typename T>
void SubtractGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                        const phi::DenseTensor& dout, int, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  BinaryGrad<T>(ctx, x, y, dout, dx, dy, [](C<T> g, C<T>, C<T>) { return g; }, [](C<T> g, C<T>, C<T>) { return -g; });
}

template <typename T>
void MultiplyGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                        const phi::DenseTensor& dout, int, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  BinaryGrad<T>(ctx, x, y, dout, dx, dy, [](C<T> g, C<T>, C<T> b) { return g * b; },
                [](C<T> g, C<T> a, C<T>) { return g * a; }, true);
}

template <typename T>
void DivideGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                      const phi::DenseTensor&, const phi::DenseTensor& dout, int, phi::DenseTensor* dx,
                      phi::DenseTensor* dy) { XFW_HIT();
  BinaryGrad<T>(ctx, x, y, dout, dx, dy, [](C<T> g, C<T>, C<T> b) { return g / b; },
                [](C<T> g, C<T> a, C<T> b) { return -g * a / (b * b); }, true);
}

template <typename T>
void AddNKernel(const phi::Context& ctx, const std::vector<const phi::DenseTensor*>& xs, phi::DenseTensor* out) { XFW_HIT();
  PD_CHECK(!xs.empty(), "xfw testcpu: add_n of nothing");
  int64_t n = xs[0]->numel();
  std::vector<C<T>> acc(n, 0);
  for (auto* x : xs) {
    const T* p = x->data<T>();
    for (int64_t i = 0; i < n; ++i) acc[i] += Ld(p[i]);
  }
  out->Resize(xs[0]->dims());
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0; i < n; ++i) p[i] = St<T>(acc[i]);
}

// Adam and AdamW as Paddle computes them (phi::funcs::AdamFunctor / AdamWFunctor): the update runs in
// fp32 on the master weight when multi_precision is set, moments are fp32 then, and the low-precision
// parameter is the master weight rounded once.
template <typename T>
void AdamCommon(const phi::Context& ctx, const phi::DenseTensor& param, const phi::DenseTensor& grad,
                float lr, const phi::DenseTensor& moment1,
                const phi::DenseTensor& moment2, const paddle::optional<phi::DenseTensor>& moment2_max,
                const phi::DenseTensor& beta1_pow, const phi::DenseTensor& beta2_pow,
                const paddle::optional<phi::DenseTensor>& master_param,
                const paddle::optional<phi::DenseTensor>& skip_update, double beta1, double beta2,
                double epsilon, float decay, bool multi_precision, bool use_global_beta_pow, bool amsgrad,
                phi::DenseTensor* param_out, phi::DenseTensor* m1_out, phi::DenseTensor* m2_out,
                phi::DenseTensor* m2max_out, phi::DenseTensor* b1p_out, phi::DenseTensor* b2p_out,
                phi::DenseTensor* master_out) {
  int64_t n = param.numel();
  bool skip = false;
  if (skip_update) skip = skip_update->data<bool>()[0];
  bool use_master = multi_precision && master_param;
  std::vector<float> p = use_master ? ToF32(*master_param) : ToF32(param);
  std::vector<float> g = ToF32(grad);
  std::vector<float> m1 = ToF32(moment1), m2 = ToF32(moment2);
  std::vector<float> m2m = (amsgrad && moment2_max) ? ToF32(*moment2_max) : std::vector<float>();
  float b1p = ToF32(beta1_pow)[0], b2p = ToF32(beta2_pow)[0];
  float b1 = float(beta1), b2 = float(beta2), eps = float(epsilon);
  if (!skip) {
    float lr_t = lr * std::sqrt(1.f - b2p) / (1.f - b1p);
    float eps_t = eps * std::sqrt(1.f - b2p);
    for (int64_t i = 0; i < n; ++i) {
      float pi = p[i];
      if (decay != 0.f) pi -= lr * decay * pi;
      m1[i] = b1 * m1[i] + (1.f - b1) * g[i];
      m2[i] = b2 * m2[i] + (1.f - b2) * g[i] * g[i];
      float v = m2[i];
      if (amsgrad && !m2m.empty()) { m2m[i] = std::max(m2m[i], m2[i]); v = m2m[i]; }
      p[i] = pi - lr_t * (m1[i] / (std::sqrt(v) + eps_t));
    }
  }
  param_out->Resize(param.dims());
  StoreF32(ctx, param_out, p.data(), n);
  m1_out->Resize(moment1.dims());
  StoreF32(ctx, m1_out, m1.data(), n);
  m2_out->Resize(moment2.dims());
  StoreF32(ctx, m2_out, m2.data(), n);
  if (m2max_out && !m2m.empty()) { m2max_out->Resize(moment2_max->dims()); StoreF32(ctx, m2max_out, m2m.data(), n); }
  if (use_master && master_out) { master_out->Resize(master_param->dims()); StoreF32(ctx, master_out, p.data(), n); }
  if (!use_global_beta_pow) {
    float nb1 = skip ? b1p : b1p * b1, nb2 = skip ? b2p : b2p * b2;
    if (b1p_out) { b1p_out->Resize(beta1_pow.dims()); StoreF32(ctx, b1p_out, &nb1, 1); }
    if (b2p_out) { b2p_out->Resize(beta2_pow.dims()); StoreF32(ctx, b2p_out, &nb2, 1); }
  }
}

template <typename T>
void AdamwKernel(const phi::Context& ctx, const phi::DenseTensor& param, const phi::DenseTensor& grad,
                 const phi::DenseTensor& lr, const phi::DenseTensor& m1, const phi::DenseTensor& m2,
                 const paddle::optional<phi::DenseTensor>& m2max, const phi::DenseTensor& b1p,
                 const phi::DenseTensor& b2p, const paddle::optional<phi::DenseTensor>& master,
                 const paddle::optional<phi::DenseTensor>& skip, const phi::Scalar& beta1,
                 const phi::Scalar& beta2, const phi::Scalar& epsilon, float lr_ratio, float coeff,
                 bool with_decay, bool, int64_t, bool multi_precision, bool use_global_beta_pow, bool amsgrad,
                 phi::DenseTensor* param_out, phi::DenseTensor* m1_out, phi::DenseTensor* m2_out,
                 phi::DenseTensor* m2max_out, phi::DenseTensor* b1p_out, phi::DenseTensor* b2p_out,
                 phi::DenseTensor* master_out) { XFW_HIT();
  // lr_ratio scales the learning rate before both its uses (decay and step), as Paddle's kernel does.
  float lr_eff = ToF32(lr)[0] * lr_ratio;
  AdamCommon<T>(ctx, param, grad, lr_eff, m1, m2, m2max, b1p, b2p, master, skip, beta1.to<double>(),
                beta2.to<double>(), epsilon.to<double>(), with_decay ? coeff : 0.f, multi_precision,
                use_global_beta_pow, amsgrad, param_out, m1_out, m2_out, m2max_out, b1p_out, b2p_out,
                master_out);
}

template <typename T>
void AdamKernel(const phi::Context& ctx, const phi::DenseTensor& param, const phi::DenseTensor& grad,
                const phi::DenseTensor& lr, const phi::DenseTensor& m1, const phi::DenseTensor& m2,
                const paddle::optional<phi::DenseTensor>& m2max, const phi::DenseTensor& b1p,
                const phi::DenseTensor& b2p, const paddle::optional<phi::DenseTensor>& master,
                const paddle::optional<phi::DenseTensor>& skip, const phi::Scalar& beta1,
                const phi::Scalar& beta2, const phi::Scalar& epsilon, bool, int64_t, bool multi_precision,
                bool use_global_beta_pow, bool amsgrad, phi::DenseTensor* param_out, phi::DenseTensor* m1_out,
                phi::DenseTensor* m2_out, phi::DenseTensor* m2max_out, phi::DenseTensor* b1p_out,
                phi::DenseTensor* b2p_out, phi::DenseTensor* master_out) { XFW_HIT();
  AdamCommon<T>(ctx, param, grad, ToF32(lr)[0], m1, m2, m2max, b1p, b2p, master, skip, beta1.to<double>(),
                beta2.to<double>(), epsilon.to<double>(), 0.f, multi_precision, use_global_beta_pow, amsgrad,
                param_out, m1_out, m2_out, m2max_out, b1p_out, b2p_out, master_out);
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT: the registration macros name kernels unqualified
PD_BUILD_PHI_KERNEL(full, testcpu, ALL_LAYOUT, FullKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(full_like, testcpu, ALL_LAYOUT, FullLikeKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(fill, testcpu, ALL_LAYOUT, FillKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(assign, testcpu, ALL_LAYOUT, AssignKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(cast, testcpu, ALL_LAYOUT, CastKernel, XFW_ALL) {}
PD_BUILD_PHI_KERNEL(scale, testcpu, ALL_LAYOUT, ScaleKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(div_scale, testcpu, ALL_LAYOUT, DivScaleKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(add, testcpu, ALL_LAYOUT, AddKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(subtract, testcpu, ALL_LAYOUT, SubtractKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(multiply, testcpu, ALL_LAYOUT, MultiplyKernel, XFW_NUMBERS, bool) {}
PD_BUILD_PHI_KERNEL(divide, testcpu, ALL_LAYOUT, DivideKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(maximum, testcpu, ALL_LAYOUT, MaximumKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(minimum, testcpu, ALL_LAYOUT, MinimumKernel, XFW_NUMBERS) {}
PD_BUILD_PHI_KERNEL(add_grad, testcpu, ALL_LAYOUT, AddGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(subtract_grad, testcpu, ALL_LAYOUT, SubtractGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(multiply_grad, testcpu, ALL_LAYOUT, MultiplyGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(divide_grad, testcpu, ALL_LAYOUT, DivideGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(add_n, testcpu, ALL_LAYOUT, AddNKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(adamw, testcpu, ALL_LAYOUT, AdamwKernel, float, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(adam, testcpu, ALL_LAYOUT, AdamKernel, float, phi::dtype::float16, phi::dtype::bfloat16) {}
