// A direct check of the test device's shared-memory collectives (collectives.cc), for what Paddle 3.3.1
// cannot call through a custom device: ReduceOp.AVG (ProcessGroupCustom accepts only sum/max/min/prod;
// dist.all_reduce's AVG path asks for NCCL's version). Not part of the plugin (the build script compiles
// only testdevice/*.cc); tests/contract/test_testdevice_collectives.py compiles and runs it:
//
//   g++ -std=c++17 -O1 -I<paddle>/include -Iadapters/paddle/testdevice check/collectives_check.cc collectives.cc -lrt
//
// For 2 and 3 ranks (forked processes on one segment), fp32 and bf16: all_reduce and reduce_scatter with
// AVG and SUM, reduce to a root, broadcast, all_gather, each against the value computed here, exactly
// (fp32 sums of small integers are exact; the average is that sum divided once, then rounded once).
// Prints one line per mismatch and exits 1 if any; exits 0 and prints "ok" otherwise.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "collectives.h"
#include "dtype.h"

using namespace xfw_testcpu;  // NOLINT

namespace {

constexpr int kN = 12;  // elements per rank (divisible by 2 and 3 for reduce_scatter)

float Value(int rank, int i) { return float(i * (rank + 1) + 3 * rank); }

int failures = 0;

void Expect(const char* what, int nranks, int rank, const char* dtype, int i, float got, float want) {
  if (got == want || (got != got && want != want)) return;
  std::printf("%s: %d ranks, rank %d, %s, element %d: got %.9g, want %.9g\n", what, nranks, rank, dtype, i, got, want);
  ++failures;
}

template <typename T>
std::vector<T> Encode(const std::vector<float>& v);
template <>
std::vector<float> Encode<float>(const std::vector<float>& v) { return v; }
template <>
std::vector<bf16> Encode<bf16>(const std::vector<float>& v) {
  std::vector<bf16> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16{FloatToBF16Bits(v[i])};
  return out;
}
float Decode(float v) { return v; }
float Decode(bf16 v) { return BF16BitsToFloat(v.x); }
float Round(float v, float) { return v; }
float Round(float v, bf16) { return BF16BitsToFloat(FloatToBF16Bits(v)); }

template <typename T>
void RunRank(Comm* c, C_DataType type, const char* dtype) {
  int n = c->nranks, rank = c->rank;
  std::vector<float> mine(kN);
  for (int i = 0; i < kN; ++i) mine[i] = Value(rank, i);
  std::vector<T> send = Encode<T>(mine), recv(kN);
  auto sum = [&](int i) { float s = 0; for (int r = 0; r < n; ++r) s += Value(r, i); return s; };
  for (C_CCLReduceOp op : {SUM, AVG, MAX}) {
    const char* name = op == SUM ? "all_reduce sum" : op == AVG ? "all_reduce avg" : "all_reduce max";
    AllReduce(c, send.data(), recv.data(), kN, type, op, -1);
    for (int i = 0; i < kN; ++i) {
      float want = op == SUM ? sum(i) : op == AVG ? sum(i) / float(n) : Value(n - 1, i);
      Expect(name, n, rank, dtype, i, Decode(recv[i]), Round(want, T()));
    }
  }
  std::vector<T> root(kN, Encode<T>({-1.f})[0]);
  AllReduce(c, send.data(), root.data(), kN, type, SUM, 0);
  for (int i = 0; i < kN; ++i) Expect("reduce to 0", n, rank, dtype, i, Decode(root[i]), rank == 0 ? Round(sum(i), T()) : -1.f);
  int block = kN / n;
  for (C_CCLReduceOp op : {SUM, AVG}) {
    std::vector<T> part(block);
    ReduceScatter(c, send.data(), part.data(), block, type, op);
    for (int i = 0; i < block; ++i) {
      int j = rank * block + i;
      Expect(op == SUM ? "reduce_scatter sum" : "reduce_scatter avg", n, rank, dtype, j, Decode(part[i]),
             Round(op == SUM ? sum(j) : sum(j) / float(n), T()));
    }
  }
  std::vector<T> all(kN * n);
  AllGather(c, send.data(), all.data(), kN, type);
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < kN; ++i) Expect("all_gather", n, rank, dtype, r * kN + i, Decode(all[r * kN + i]), Round(Value(r, i), T()));
  std::vector<T> b = send;
  Broadcast(c, b.data(), kN, type, n - 1);
  for (int i = 0; i < kN; ++i) Expect("broadcast", n, rank, dtype, i, Decode(b[i]), Round(Value(n - 1, i), T()));
}

}  // namespace

int main() {
  for (int n : {2, 3}) {
    std::string name = "/xfw_collectives_check_" + std::to_string(getpid()) + "_" + std::to_string(n);
    std::vector<pid_t> children;
    int rank = 0;
    for (int r = 1; r < n; ++r) {
      pid_t pid = fork();
      if (pid == 0) { rank = r; children.clear(); break; }
      children.push_back(pid);
    }
    Comm* c = CommOpen(name, n, rank);
    if (!c) { std::printf("CommOpen failed: %d ranks, rank %d\n", n, rank); return 1; }
    RunRank<float>(c, FLOAT32, "float32");
    RunRank<bf16>(c, BFLOAT16, "bfloat16");
    Barrier(c);
    CommClose(c);
    if (rank != 0) return failures ? 1 : 0;
    for (pid_t pid : children) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) { std::printf("rank of pid %d failed\n", int(pid)); ++failures; }
    }
  }
  if (!failures) std::printf("ok\n");
  return failures ? 1 : 0;
}
