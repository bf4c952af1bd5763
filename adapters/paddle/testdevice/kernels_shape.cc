// Masking and shape kernels the tiny decoders run in bf16 (the CPU build has no bf16 kernel for
// them): triu/tril, where, expand, and sin/cos/erf for rotary embeddings and exact GELU pieces.
#include <algorithm>
#include <string>

#include "kernels.h"

namespace xfw_testcpu {

template <typename T>
void Tri(const phi::Context& ctx, const phi::DenseTensor& x, int diagonal, bool lower, phi::DenseTensor* out) {
  Dims d = x.dims();
  int64_t rows = d.size() >= 2 ? d[d.size() - 2] : 1, cols = d.back(), mats = Numel(d) / (rows * cols);
  const T* px = x.data<T>();
  out->Resize(d);
  T* p = ctx.Alloc<T>(out);
  for (int64_t m = 0; m < mats; ++m)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        int64_t i = (m * rows + r) * cols + c;
        bool keep = lower ? (c - r <= diagonal) : (c - r >= diagonal);
        p[i] = keep ? px[i] : St<T>(0.f);
      }
}
template <typename T>
void TriuKernel(const phi::Context& ctx, const phi::DenseTensor& x, int diagonal, phi::DenseTensor* out) { XFW_HIT(); Tri<T>(ctx, x, diagonal, false, out); }
template <typename T>
void TrilKernel(const phi::Context& ctx, const phi::DenseTensor& x, int diagonal, phi::DenseTensor* out) { XFW_HIT(); Tri<T>(ctx, x, diagonal, true, out); }
template <typename T>
void TriuGradKernel(const phi::Context& ctx, const phi::DenseTensor& dout, int diagonal, phi::DenseTensor* dx) { XFW_HIT(); Tri<T>(ctx, dout, diagonal, false, dx); }
template <typename T>
void TrilGradKernel(const phi::Context& ctx, const phi::DenseTensor& dout, int diagonal, phi::DenseTensor* dx) { XFW_HIT(); Tri<T>(ctx, dout, diagonal, true, dx); }

template <typename T>
void WhereKernel(const phi::Context& ctx, const phi::DenseTensor& cond, const phi::DenseTensor& x, const phi::DenseTensor& y,
                 phi::DenseTensor* out) { XFW_HIT();
  Broadcast xy(x.dims(), y.dims());
  Broadcast all(cond.dims(), xy.out);
  Broadcast bx(x.dims(), all.out), by(y.dims(), all.out);
  const bool* pc = cond.data<bool>();
  const T* px = x.data<T>();
  const T* py = y.data<T>();
  std::vector<int64_t> ix(Numel(all.out)), iy(ix.size());
  bx.Each([&](int64_t i, int64_t a, int64_t) { ix[i] = a; });
  by.Each([&](int64_t i, int64_t a, int64_t) { iy[i] = a; });
  out->Resize(all.out);
  T* p = ctx.Alloc<T>(out);
  all.Each([&](int64_t i, int64_t ic, int64_t) { p[i] = pc[ic] ? px[ix[i]] : py[iy[i]]; });
}
template <typename T>
void WhereGradKernel(const phi::Context& ctx, const phi::DenseTensor& cond, const phi::DenseTensor& x, const phi::DenseTensor& y,
                     const phi::DenseTensor& dout, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  PD_CHECK(cond.numel() == dout.numel() && x.numel() == dout.numel() && y.numel() == dout.numel(),
           "xfw testcpu where_grad: broadcast operands are not implemented");
  const bool* pc = cond.data<bool>();
  const T* pg = dout.data<T>();
  T zero = St<T>(0.f);
  if (dx) { dx->Resize(x.dims()); T* p = ctx.Alloc<T>(dx); for (int64_t i = 0, n = dout.numel(); i < n; ++i) p[i] = pc[i] ? pg[i] : zero; }
  if (dy) { dy->Resize(y.dims()); T* p = ctx.Alloc<T>(dy); for (int64_t i = 0, n = dout.numel(); i < n; ++i) p[i] = pc[i] ? zero : pg[i]; }
}

Dims ExpandDims(const Dims& x, const std::vector<int64_t>& shape) {
  Dims out(shape.size());
  size_t off = shape.size() - x.size();
  for (size_t i = 0; i < shape.size(); ++i) out[i] = shape[i] == -1 ? x[i - off] : shape[i];
  return out;
}
template <typename T>
void ExpandKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::IntArray& shape, phi::DenseTensor* out) { XFW_HIT();
  Broadcast b(x.dims(), ExpandDims(x.dims(), shape.GetData()));
  const T* px = x.data<T>();
  out->Resize(b.out);
  T* p = ctx.Alloc<T>(out);
  b.Each([&](int64_t i, int64_t ix, int64_t) { p[i] = px[ix]; });
}
template <typename T>
void ExpandGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::IntArray&,
                      phi::DenseTensor* dx) { XFW_HIT();
  Broadcast b(x.dims(), dout.dims());
  const T* pg = dout.data<T>();
  std::vector<float> acc(x.numel(), 0.f);
  b.Each([&](int64_t i, int64_t ix, int64_t) { acc[ix] += static_cast<float>(Ld(pg[i])); });
  dx->Resize(x.dims());
  T* p = ctx.Alloc<T>(dx);
  for (size_t i = 0; i < acc.size(); ++i) p[i] = St<T>(acc[i]);
}

#define XFW_UNARY_F(Name, f, df)                                                                                      \
  template <typename T>                                                                                               \
  void Name##Kernel(const phi::Context& ctx, const phi::DenseTensor& x, phi::DenseTensor* out) { XFW_HIT();           \
    out->Resize(x.dims());                                                                                            \
    const T* px = x.data<T>();                                                                                        \
    T* p = ctx.Alloc<T>(out);                                                                                         \
    for (int64_t i = 0, n = x.numel(); i < n; ++i) { float v = static_cast<float>(Ld(px[i])); p[i] = St<T>(f); }     \
  }                                                                                                                   \
  template <typename T>                                                                                               \
  void Name##GradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout,            \
                        phi::DenseTensor* dx) { XFW_HIT();                                                                       \
    dx->Resize(x.dims());                                                                                             \
    const T* px = x.data<T>();                                                                                        \
    const T* pg = dout.data<T>();                                                                                     \
    T* p = ctx.Alloc<T>(dx);                                                                                          \
    for (int64_t i = 0, n = x.numel(); i < n; ++i) {                                                                  \
      float v = static_cast<float>(Ld(px[i])), g = static_cast<float>(Ld(pg[i]));                                     \
      p[i] = St<T>(g * (df));                                                                                         \
    }                                                                                                                 \
  }
XFW_UNARY_F(Sin, std::sin(v), std::cos(v))
XFW_UNARY_F(Cos, std::cos(v), -std::sin(v))
XFW_UNARY_F(Erf, std::erf(v), 1.1283791670955126f * std::exp(-v * v))

// swiglu(x, y) = silu(x) * y; without y, x's last dimension holds [x | y].
template <typename T>
void SwiGLUKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& y,
                  phi::DenseTensor* out) { XFW_HIT();
  Dims d = x.dims();
  int64_t n = d.back(), m = Numel(d) / n, half = y ? n : n / 2;
  const T* px = x.data<T>();
  const T* py = y ? y->data<T>() : nullptr;
  Dims od = d;
  od.back() = half;
  out->Resize(od);
  T* p = ctx.Alloc<T>(out);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < half; ++c) {
      float a = static_cast<float>(Ld(y ? px[r * n + c] : px[r * n + c]));
      float b = static_cast<float>(Ld(y ? py[r * n + c] : px[r * n + half + c]));
      p[r * half + c] = St<T>(a / (1.f + std::exp(-a)) * b);
    }
}
template <typename T>
void SwiGLUGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const paddle::optional<phi::DenseTensor>& y,
                      const phi::DenseTensor& dz, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  Dims d = x.dims();
  int64_t n = d.back(), m = Numel(d) / n, half = y ? n : n / 2;
  const T* px = x.data<T>();
  const T* py = y ? y->data<T>() : nullptr;
  const T* pg = dz.data<T>();
  T* qx = nullptr;
  T* qy = nullptr;
  if (dx) { dx->Resize(d); qx = ctx.Alloc<T>(dx); }
  if (dy && y) { dy->Resize(y->dims()); qy = ctx.Alloc<T>(dy); }
  for (int64_t r = 0; r < m; ++r)
    for (int64_t c = 0; c < half; ++c) {
      float a = static_cast<float>(Ld(px[r * n + c]));
      float b = static_cast<float>(Ld(y ? py[r * n + c] : px[r * n + half + c]));
      float g = static_cast<float>(Ld(pg[r * half + c]));
      float s = 1.f / (1.f + std::exp(-a));
      float da = g * b * s * (1.f + a * (1.f - s)), db = g * a * s;
      if (qx) qx[r * n + c] = St<T>(da);
      if (y) { if (qy) qy[r * n + c] = St<T>(db); } else if (qx) { qx[r * n + half + c] = St<T>(db); }
    }
}

// concat's gradient: each input's slice of out_grad along the axis (x may come without buffers).
template <typename T>
void ConcatGradKernel(const phi::Context& ctx, const std::vector<const phi::DenseTensor*>& xs, const phi::DenseTensor& dout,
                      const phi::Scalar& axis_scalar, std::vector<phi::DenseTensor*> dxs) { XFW_HIT();
  Dims d = dout.dims();
  int64_t axis = static_cast<int64_t>(axis_scalar.to<double>());
  if (axis < 0) axis += static_cast<int64_t>(d.size());
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < axis; ++i) outer *= d[i];
  for (size_t i = axis + 1; i < d.size(); ++i) inner *= d[i];
  const T* pg = dout.data<T>();
  int64_t start = 0;
  for (size_t k = 0; k < xs.size(); ++k) {
    int64_t len = xs[k]->dims()[axis];
    if (k < dxs.size() && dxs[k]) {
      dxs[k]->Resize(xs[k]->dims());
      T* p = ctx.Alloc<T>(dxs[k]);
      for (int64_t o = 0; o < outer; ++o)
        std::memcpy(p + o * len * inner, pg + (o * d[axis] + start) * inner, sizeof(T) * len * inner);
    }
    start += len;
  }
}

// pad3d (NCDHW; paddings [left, right, top, bottom, front, back]): constant and replicate modes.
struct Pad3 {
  int64_t n, c, d, h, w, od, oh, ow, pl, pt, pf;
  Pad3(const Dims& x, const std::vector<int64_t>& p, const std::string& layout) {
    PD_CHECK(layout == "NCDHW" && x.size() == 5 && p.size() == 6, "xfw testcpu pad3d: NCDHW with 6 paddings only");
    n = x[0]; c = x[1]; d = x[2]; h = x[3]; w = x[4];
    pl = p[0]; pt = p[2]; pf = p[4];
    ow = w + p[0] + p[1]; oh = h + p[2] + p[3]; od = d + p[4] + p[5];
  }
  // input index feeding output (z, y, x) of plane nc, or -1 for the constant
  int64_t Source(int64_t nc, int64_t z, int64_t y, int64_t x, bool replicate) const {
    int64_t iz = z - pf, iy = y - pt, ix = x - pl;
    if (replicate) {
      iz = std::min(std::max<int64_t>(iz, 0), d - 1); iy = std::min(std::max<int64_t>(iy, 0), h - 1);
      ix = std::min(std::max<int64_t>(ix, 0), w - 1);
    } else if (iz < 0 || iz >= d || iy < 0 || iy >= h || ix < 0 || ix >= w) {
      return -1;
    }
    return ((nc * d + iz) * h + iy) * w + ix;
  }
};

template <typename T>
void Pad3dKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::IntArray& paddings, const std::string& mode,
                 double pad_value, const std::string& layout, phi::DenseTensor* out) { XFW_HIT();
  PD_CHECK(mode == "constant" || mode == "replicate", "xfw testcpu pad3d: mode %s is not implemented", mode.c_str());
  Pad3 s(x.dims(), paddings.GetData(), layout);
  const T* px = x.data<T>();
  out->Resize({s.n, s.c, s.od, s.oh, s.ow});
  T* p = ctx.Alloc<T>(out);
  T fill = St<T>(static_cast<float>(pad_value));
  int64_t o = 0;
  for (int64_t nc = 0; nc < s.n * s.c; ++nc)
    for (int64_t z = 0; z < s.od; ++z)
      for (int64_t y = 0; y < s.oh; ++y)
        for (int64_t xx = 0; xx < s.ow; ++xx, ++o) {
          int64_t i = s.Source(nc, z, y, xx, mode == "replicate");
          p[o] = i < 0 ? fill : px[i];
        }
}

template <typename T>
void Pad3dGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::IntArray& paddings,
                     const std::string& mode, double, const std::string& layout, phi::DenseTensor* dx) { XFW_HIT();
  PD_CHECK(mode == "constant" || mode == "replicate", "xfw testcpu pad3d_grad: mode %s is not implemented", mode.c_str());
  Pad3 s(x.dims(), paddings.GetData(), layout);
  const T* pg = dout.data<T>();
  std::vector<float> acc(x.numel(), 0.f);
  int64_t o = 0;
  for (int64_t nc = 0; nc < s.n * s.c; ++nc)
    for (int64_t z = 0; z < s.od; ++z)
      for (int64_t y = 0; y < s.oh; ++y)
        for (int64_t xx = 0; xx < s.ow; ++xx, ++o) {
          int64_t i = s.Source(nc, z, y, xx, mode == "replicate");
          if (i >= 0) acc[i] += static_cast<float>(Ld(pg[o]));
        }
  dx->Resize(x.dims());
  T* p = ctx.Alloc<T>(dx);
  for (size_t i = 0; i < acc.size(); ++i) p[i] = St<T>(acc[i]);
}

template <typename T>
void ClipKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::Scalar& lo, const phi::Scalar& hi,
                phi::DenseTensor* out) { XFW_HIT();
  float a = static_cast<float>(lo.to<double>()), b = static_cast<float>(hi.to<double>());
  out->Resize(x.dims());
  const T* px = x.data<T>();
  T* p = ctx.Alloc<T>(out);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) p[i] = St<T>(std::min(std::max(static_cast<float>(Ld(px[i])), a), b));
}
template <typename T>
void ClipGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& dout, const phi::Scalar& lo,
                    const phi::Scalar& hi, phi::DenseTensor* dx) { XFW_HIT();
  float a = static_cast<float>(lo.to<double>()), b = static_cast<float>(hi.to<double>());
  dx->Resize(x.dims());
  const T* px = x.data<T>();
  const T* pg = dout.data<T>();
  T* p = ctx.Alloc<T>(dx);
  for (int64_t i = 0, n = x.numel(); i < n; ++i) {
    float v = static_cast<float>(Ld(px[i]));
    p[i] = (v > a && v < b) ? pg[i] : St<T>(0.f);
  }
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(triu, testcpu, ALL_LAYOUT, TriuKernel, XFW_FLOATS, bool, int32_t, int64_t) {}
PD_BUILD_PHI_KERNEL(tril, testcpu, ALL_LAYOUT, TrilKernel, XFW_FLOATS, bool, int32_t, int64_t) {}
PD_BUILD_PHI_KERNEL(triu_grad, testcpu, ALL_LAYOUT, TriuGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(tril_grad, testcpu, ALL_LAYOUT, TrilGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(where, testcpu, ALL_LAYOUT, WhereKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(where_grad, testcpu, ALL_LAYOUT, WhereGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(expand, testcpu, ALL_LAYOUT, ExpandKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(expand_grad, testcpu, ALL_LAYOUT, ExpandGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(sin, testcpu, ALL_LAYOUT, SinKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(sin_grad, testcpu, ALL_LAYOUT, SinGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(cos, testcpu, ALL_LAYOUT, CosKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(cos_grad, testcpu, ALL_LAYOUT, CosGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(erf, testcpu, ALL_LAYOUT, ErfKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(swiglu, testcpu, ALL_LAYOUT, SwiGLUKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(swiglu_grad, testcpu, ALL_LAYOUT, SwiGLUGradKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(erf_grad, testcpu, ALL_LAYOUT, ErfGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(concat_grad, testcpu, ALL_LAYOUT, ConcatGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(pad3d, testcpu, ALL_LAYOUT, Pad3dKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(pad3d_grad, testcpu, ALL_LAYOUT, Pad3dGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(clip, testcpu, ALL_LAYOUT, ClipKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
PD_BUILD_PHI_KERNEL(clip_grad, testcpu, ALL_LAYOUT, ClipGradKernel, phi::dtype::float16, phi::dtype::bfloat16) {}
