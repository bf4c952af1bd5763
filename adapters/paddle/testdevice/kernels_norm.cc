// layer_norm and group_norm with their gradients for every floating type (the tiny decoders, vision
// towers and UNets run them in bf16 under AMP; the CPU build has no bf16 kernels). fp32 inside; mean and
// variance are stored in the dtype Paddle's InferMeta gave them.
#include <string>

#include "kernels.h"

namespace xfw_testcpu {

template <typename T>
void LayerNormKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& scale,
                     const paddle::optional<phi::DenseTensor>& bias, float eps, int begin, phi::DenseTensor* out,
                     phi::DenseTensor* mean, phi::DenseTensor* var) { XFW_HIT();
  Dims d = x.dims();
  int64_t rows = 1, cols = 1;
  for (int i = 0; i < static_cast<int>(d.size()); ++i) (i < begin ? rows : cols) *= d[i];
  std::vector<float> v = ToF32(x), w, b, mu(rows), va(rows);
  if (scale) w = ToF32(*scale);
  if (bias) b = ToF32(*bias);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = &v[r * cols];
    double s = 0, s2 = 0;
    for (int64_t c = 0; c < cols; ++c) s += row[c];
    float m = static_cast<float>(s / cols);
    for (int64_t c = 0; c < cols; ++c) s2 += double(row[c] - m) * (row[c] - m);
    float var_r = static_cast<float>(s2 / cols), inv = 1.f / std::sqrt(var_r + eps);
    mu[r] = m; va[r] = var_r;
    for (int64_t c = 0; c < cols; ++c) {
      float y = (row[c] - m) * inv;
      if (!w.empty()) y *= w[c];
      if (!b.empty()) y += b[c];
      row[c] = y;
    }
  }
  out->Resize(d);
  out->set_dtype(x.dtype());
  StoreF32(ctx, out, v.data(), static_cast<int64_t>(v.size()));
  if (mean) { mean->Resize({rows}); mean->set_dtype(PD_DataType::FLOAT32); StoreF32(ctx, mean, mu.data(), rows); }
  if (var) { var->Resize({rows}); var->set_dtype(PD_DataType::FLOAT32); StoreF32(ctx, var, va.data(), rows); }
}

template <typename T>
void LayerNormGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& scale,
                         const paddle::optional<phi::DenseTensor>& bias, const phi::DenseTensor& mean,
                         const phi::DenseTensor& var, const phi::DenseTensor& dout, float eps, int begin,
                         phi::DenseTensor* dx, phi::DenseTensor* dscale, phi::DenseTensor* dbias) { XFW_HIT();
  Dims d = x.dims();
  int64_t rows = 1, cols = 1;
  for (int i = 0; i < static_cast<int>(d.size()); ++i) (i < begin ? rows : cols) *= d[i];
  std::vector<float> v = ToF32(x), g = ToF32(dout), mu = ToF32(mean), va = ToF32(var), w, gx(v.size());
  if (scale) w = ToF32(*scale);
  std::vector<float> gw(cols, 0.f), gb(cols, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float inv = 1.f / std::sqrt(va[r] + eps);
    double sg = 0, sgx = 0;
    for (int64_t c = 0; c < cols; ++c) {
      float xh = (v[r * cols + c] - mu[r]) * inv, gy = g[r * cols + c];
      gw[c] += gy * xh;
      gb[c] += gy;
      float gh = w.empty() ? gy : gy * w[c];
      sg += gh;
      sgx += gh * xh;
    }
    for (int64_t c = 0; c < cols; ++c) {
      float xh = (v[r * cols + c] - mu[r]) * inv, gy = g[r * cols + c];
      float gh = w.empty() ? gy : gy * w[c];
      gx[r * cols + c] = inv * (gh - static_cast<float>(sg / cols) - xh * static_cast<float>(sgx / cols));
    }
  }
  if (dx) { dx->Resize(d); dx->set_dtype(x.dtype()); StoreF32(ctx, dx, gx.data(), static_cast<int64_t>(gx.size())); }
  if (dscale && scale) { dscale->Resize(scale->dims()); dscale->set_dtype(scale->dtype()); StoreF32(ctx, dscale, gw.data(), cols); }
  if (dbias && bias) { dbias->Resize(bias->dims()); dbias->set_dtype(bias->dtype()); StoreF32(ctx, dbias, gb.data(), cols); }
}

// ---- group_norm (channel-first) ------------------------------------------------------------------------
struct Groups {
  int64_t n, c, g, per_c, per_g;  // per_c: spatial elements per channel; per_g: elements per group
  Groups(const Dims& d, int groups) : n(d[0]), c(d[1]), g(groups) {
    per_c = Numel(d) / (n * c);
    per_g = per_c * (c / g);
  }
};

template <typename T>
void GroupNormKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& scale,
                     const paddle::optional<phi::DenseTensor>& bias, double eps, int groups, const std::string& layout,
                     phi::DenseTensor* y, phi::DenseTensor* mean, phi::DenseTensor* var) { XFW_HIT();
  PD_CHECK(layout == "NCHW" || layout == "NCDHW" || layout == "NCL", "xfw testcpu group_norm: channel-first only");
  Groups s(x.dims(), groups);
  std::vector<float> v = ToF32(x), w, b, mu(s.n * s.g), va(s.n * s.g);
  if (scale) w = ToF32(*scale);
  if (bias) b = ToF32(*bias);
  for (int64_t i = 0; i < s.n * s.g; ++i) {
    float* p = &v[i * s.per_g];
    double s1 = 0, s2 = 0;
    for (int64_t k = 0; k < s.per_g; ++k) s1 += p[k];
    float m = static_cast<float>(s1 / s.per_g);
    for (int64_t k = 0; k < s.per_g; ++k) s2 += double(p[k] - m) * (p[k] - m);
    float vr = static_cast<float>(s2 / s.per_g), inv = 1.f / std::sqrt(vr + static_cast<float>(eps));
    mu[i] = m; va[i] = vr;
    int64_t c0 = (i % s.g) * (s.c / s.g);
    for (int64_t k = 0; k < s.per_g; ++k) {
      int64_t c = c0 + k / s.per_c;
      float o = (p[k] - m) * inv;
      if (!w.empty()) o *= w[c];
      if (!b.empty()) o += b[c];
      p[k] = o;
    }
  }
  y->Resize(x.dims()); y->set_dtype(x.dtype());
  StoreF32(ctx, y, v.data(), static_cast<int64_t>(v.size()));
  if (mean) { mean->Resize({s.n, s.g}); StoreF32(ctx, mean, mu.data(), s.n * s.g); }
  if (var) { var->Resize({s.n, s.g}); StoreF32(ctx, var, va.data(), s.n * s.g); }
}

template <typename T>
void GroupNormGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& scale,
                         const paddle::optional<phi::DenseTensor>& bias, const phi::DenseTensor&, const phi::DenseTensor& mean,
                         const phi::DenseTensor& var, const phi::DenseTensor& dy, double eps, int groups, const std::string&,
                         phi::DenseTensor* dx, phi::DenseTensor* dscale, phi::DenseTensor* dbias) { XFW_HIT();
  Groups s(x.dims(), groups);
  std::vector<float> v = ToF32(x), g = ToF32(dy), mu = ToF32(mean), va = ToF32(var), w, gx(v.size());
  if (scale) w = ToF32(*scale);
  std::vector<float> gw(s.c, 0.f), gb(s.c, 0.f);
  for (int64_t i = 0; i < s.n * s.g; ++i) {
    float inv = 1.f / std::sqrt(va[i] + static_cast<float>(eps));
    int64_t c0 = (i % s.g) * (s.c / s.g), base = i * s.per_g;
    double sg = 0, sgx = 0;
    for (int64_t k = 0; k < s.per_g; ++k) {
      int64_t c = c0 + k / s.per_c;
      float xh = (v[base + k] - mu[i]) * inv, gy = g[base + k], gh = w.empty() ? gy : gy * w[c];
      gw[c] += gy * xh; gb[c] += gy; sg += gh; sgx += gh * xh;
    }
    for (int64_t k = 0; k < s.per_g; ++k) {
      int64_t c = c0 + k / s.per_c;
      float xh = (v[base + k] - mu[i]) * inv, gy = g[base + k], gh = w.empty() ? gy : gy * w[c];
      gx[base + k] = inv * (gh - static_cast<float>(sg / s.per_g) - xh * static_cast<float>(sgx / s.per_g));
    }
  }
  if (dx) { dx->Resize(x.dims()); dx->set_dtype(x.dtype()); StoreF32(ctx, dx, gx.data(), static_cast<int64_t>(gx.size())); }
  if (dscale && scale) { dscale->Resize(scale->dims()); dscale->set_dtype(scale->dtype()); StoreF32(ctx, dscale, gw.data(), s.c); }
  if (dbias && bias) { dbias->Resize(bias->dims()); dbias->set_dtype(bias->dtype()); StoreF32(ctx, dbias, gb.data(), s.c); }
}

// squared_l2_norm of a low-precision tensor (ClipGradByGlobalNorm over bf16/fp16 gradients: O2 without
// master weights, precision.master_weights false): the sum of squares in double, stored in x's dtype as
// the CPU kernel stores a float's. fp32 keeps falling back to Paddle's CPU kernel.
template <typename T>
void SquaredL2NormKernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();
  const T* px = x.data<T>();
  double s = 0;
  for (int64_t i = 0, n = x.numel(); i < n; ++i) s += double(Ld(px[i])) * Ld(px[i]);
  out->Resize({1});
  *ctx.Alloc<T>(out) = St<T>(static_cast<float>(s));
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(squared_l2_norm, testcpu, ALL_LAYOUT, SquaredL2NormKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(layer_norm, testcpu, ALL_LAYOUT, LayerNormKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(layer_norm_grad, testcpu, ALL_LAYOUT, LayerNormGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(group_norm, testcpu, ALL_LAYOUT, GroupNormKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(group_norm_grad, testcpu, ALL_LAYOUT, GroupNormGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
