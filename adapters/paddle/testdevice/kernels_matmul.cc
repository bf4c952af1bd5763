// matmul and matmul_grad for every floating type (the CPU build has no bf16/fp16 matmul): operands are
// read as fp32 in their logical [batch, M, K] x [batch, K, N] shape (transposes and 1-D operands
// resolved, batch dimensions broadcast numpy-style), products accumulate in fp32, results round once.
#include "kernels.h"

namespace xfw_testcpu {
namespace {

struct Operand {
  Dims batch;
  int64_t rows = 1, cols = 1;  // logical matrix after the transpose flag
  std::vector<float> v;        // [numel(batch), rows, cols], row-major, transpose applied
};

Operand Read(const phi::DenseTensor& t, bool trans, bool is_x) {
  Operand o;
  Dims d = t.dims();
  if (d.size() == 1) trans = false;  // Paddle ignores the flag of a 1-D operand
  std::vector<float> raw = ToF32(t);
  if (d.size() == 1) d = is_x ? Dims{1, d[0]} : Dims{d[0], 1};
  o.batch.assign(d.begin(), d.end() - 2);
  int64_t r = d[d.size() - 2], c = d[d.size() - 1];
  o.rows = trans ? c : r;
  o.cols = trans ? r : c;
  int64_t nb = Numel(o.batch);
  o.v.resize(nb * r * c);
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        float val = raw[(b * r + i) * c + j];
        if (trans) o.v[(b * c + j) * r + i] = val; else o.v[(b * r + i) * c + j] = val;
      }
  return o;
}

// The output's shape as Paddle's MatmulInferMeta gives it.
Dims OutDims(const Dims& xd, const Dims& yd, const Dims& batch, int64_t m, int64_t n) {
  Dims out = batch;
  if (xd.size() > 1) out.push_back(m);
  if (yd.size() > 1) out.push_back(n);
  return out;
}

// Writes a logical [batch, rows, cols] fp32 gradient back in the operand's own layout.
void WriteBack(const phi::Context& ctx, const phi::DenseTensor& like, bool trans, const Operand& shape,
               const std::vector<float>& g, phi::DenseTensor* out) {
  Dims d = like.dims();
  if (d.size() == 1) trans = false;
  out->Resize(d);
  int64_t nb = Numel(shape.batch), r = shape.rows, c = shape.cols;
  std::vector<float> phys(g.size());
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        float v = g[(b * r + i) * c + j];
        if (trans) phys[(b * c + j) * r + i] = v; else phys[(b * r + i) * c + j] = v;
      }
  StoreF32(ctx, out, phys.data(), static_cast<int64_t>(phys.size()));
}

}  // namespace

template <typename T>
void MatmulKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y, bool tx, bool ty,
                  phi::DenseTensor* out) { XFW_HIT();
  Operand a = Read(x, tx, true), b = Read(y, ty, false);
  PD_CHECK(a.cols == b.rows, "xfw testcpu matmul: inner dimensions %d and %d differ", int(a.cols), int(b.rows));
  Broadcast bb(a.batch, b.batch);
  int64_t M = a.rows, K = a.cols, N = b.cols;
  std::vector<float> o(Numel(bb.out) * M * N, 0.f);
  bb.Each([&](int64_t i, int64_t ia, int64_t ib) {
    const float* pa = &a.v[ia * M * K];
    const float* pb = &b.v[ib * K * N];
    float* po = &o[i * M * N];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        float av = pa[m * K + k];
        for (int64_t n = 0; n < N; ++n) po[m * N + n] += av * pb[k * N + n];
      }
  });
  out->Resize(OutDims(x.dims(), y.dims(), bb.out, M, N));
  out->set_dtype(x.dtype());
  StoreF32(ctx, out, o.data(), static_cast<int64_t>(o.size()));
}

template <typename T>
void MatmulGradKernel(const phi::Context& ctx, const phi::DenseTensor& x, const phi::DenseTensor& y,
                      const phi::DenseTensor& dout, bool tx, bool ty, phi::DenseTensor* dx, phi::DenseTensor* dy) { XFW_HIT();
  Operand a = Read(x, tx, true), b = Read(y, ty, false);
  Broadcast bb(a.batch, b.batch);
  int64_t M = a.rows, K = a.cols, N = b.cols;
  std::vector<float> g = ToF32(dout);  // [batch, M, N] once 1-D operands are accounted for
  std::vector<float> ga(a.v.size(), 0.f), gb(b.v.size(), 0.f);
  bb.Each([&](int64_t i, int64_t ia, int64_t ib) {
    const float* pg = &g[i * M * N];
    const float* pa = &a.v[ia * M * K];
    const float* pb = &b.v[ib * K * N];
    float* qa = &ga[ia * M * K];
    float* qb = &gb[ib * K * N];
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) {
        float sa = 0.f;
        float av = pa[m * K + k];
        for (int64_t n = 0; n < N; ++n) {
          sa += pg[m * N + n] * pb[k * N + n];
          qb[k * N + n] += av * pg[m * N + n];
        }
        qa[m * K + k] += sa;
      }
  });
  if (dx) { dx->set_dtype(x.dtype()); WriteBack(ctx, x, tx, a, ga, dx); }
  if (dy) { dy->set_dtype(y.dtype()); WriteBack(ctx, y, ty, b, gb, dy); }
}

}  // namespace xfw_testcpu

using namespace xfw_testcpu;  // NOLINT
PD_BUILD_PHI_KERNEL(matmul, testcpu, ALL_LAYOUT, MatmulKernel, XFW_FLOATS) {}
PD_BUILD_PHI_KERNEL(matmul_grad, testcpu, ALL_LAYOUT, MatmulGradKernel, XFW_FLOATS) {}
