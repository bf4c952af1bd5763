// Shared-memory collectives: each rank copies its contribution into its own slot of a segment
// every rank of the communicator maps, all meet at a barrier, each rank reads what it needs from
// the slots, and all meet again before the slots are reused. Reductions run in rank order on every
// rank (fp16/bf16 accumulate in fp32 and round to nearest even once), so every rank gets the same
// bits. Large buffers go through in chunks of the slot size.
#include "collectives.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "dtype.h"

namespace xfw_testcpu {

constexpr size_t kSlotBytes = size_t(32) << 20;
constexpr size_t kMailBytes = size_t(4) << 20;

struct Header {
  std::atomic<int32_t> arrived;
  std::atomic<int32_t> generation;
  std::atomic<int32_t> opened;
  std::atomic<uint64_t> posted[kMaxRanks][kMaxRanks];  // [src][dst] messages written
  std::atomic<uint64_t> taken[kMaxRanks][kMaxRanks];   // [src][dst] messages read
  std::atomic<uint64_t> sizes[kMaxRanks][kMaxRanks];
  char pad[64];
};

namespace {

// Waiting for the other ranks: yield first, then sleep 50 us a round (a waiting rank must not starve
// the one it waits for on a 2-core host); after XFW_TESTCPU_TIMEOUT_S (default 600) seconds a peer is
// taken to be gone and the process aborts with a message instead of hanging a CI job.
struct Waiter {
  const char* what;
  const Comm* comm;
  unsigned spins = 0;
  timespec start{};
  Waiter(const char* w, const Comm* c) : what(w), comm(c) { clock_gettime(CLOCK_MONOTONIC, &start); }
  void Pause() {
    if (++spins < 200) { sched_yield(); return; }
    timespec ts{0, 50000};
    nanosleep(&ts, nullptr);
    if (spins % 4096 == 0) {
      static const double limit = [] {
        const char* v = std::getenv("XFW_TESTCPU_TIMEOUT_S");
        return v ? std::atof(v) : 600.0;
      }();
      timespec now{};
      clock_gettime(CLOCK_MONOTONIC, &now);
      double waited = double(now.tv_sec - start.tv_sec) + 1e-9 * double(now.tv_nsec - start.tv_nsec);
      if (waited > limit) {
        std::fprintf(stderr, "xfw testcpu: rank %d of %d waited %.0f s in %s on %s: a peer is gone; aborting\n",
                     comm->rank, comm->nranks, waited, what, comm->name.c_str());
        std::abort();
      }
    }
  }
};

size_t HeaderBytes() { return (sizeof(Header) + 4095) / 4096 * 4096; }

template <typename T>
void ReduceInto(T* out, const char* const* srcs, int n, size_t count, C_CCLReduceOp op) {
  for (size_t i = 0; i < count; ++i) {
    auto acc = ToAcc(reinterpret_cast<const T*>(srcs[0])[i]);
    for (int r = 1; r < n; ++r) {
      auto v = ToAcc(reinterpret_cast<const T*>(srcs[r])[i]);
      switch (op) {
        case SUM: case AVG: acc = acc + v; break;
        case MAX: acc = v > acc ? v : acc; break;
        case MIN: acc = v < acc ? v : acc; break;
        case PRODUCT: acc = acc * v; break;
      }
    }
    if (op == AVG) acc = acc / static_cast<decltype(acc)>(n);
    out[i] = FromAcc<T>(acc);
  }
}

bool Reduce(C_DataType t, void* out, const char* const* srcs, int n, size_t count, C_CCLReduceOp op) {
  switch (t) {
    case FLOAT32: ReduceInto(static_cast<float*>(out), srcs, n, count, op); return true;
    case FLOAT64: ReduceInto(static_cast<double*>(out), srcs, n, count, op); return true;
    case FLOAT16: ReduceInto(static_cast<f16*>(out), srcs, n, count, op); return true;
    case BFLOAT16: ReduceInto(static_cast<bf16*>(out), srcs, n, count, op); return true;
    case INT32: ReduceInto(static_cast<int32_t*>(out), srcs, n, count, op); return true;
    case INT64: ReduceInto(static_cast<int64_t*>(out), srcs, n, count, op); return true;
    case INT8: ReduceInto(static_cast<int8_t*>(out), srcs, n, count, op); return true;
    case UINT8: ReduceInto(static_cast<uint8_t*>(out), srcs, n, count, op); return true;
    case BOOL: ReduceInto(static_cast<uint8_t*>(out), srcs, n, count, op == SUM ? MAX : op); return true;
    default:
      std::fprintf(stderr, "xfw testcpu: reduction of data type %d is not implemented\n", static_cast<int>(t));
      return false;
  }
}

char* Slot(Comm* c, int r) { return c->slots + size_t(r) * kSlotBytes; }

}  // namespace

size_t ElementSize(C_DataType t) {
  switch (t) {
    case BOOL: case UINT8: case INT8: return 1;
    case UINT16: case INT16: case FLOAT16: case BFLOAT16: return 2;
    case UINT32: case INT32: case FLOAT32: return 4;
    case UINT64: case INT64: case FLOAT64: case COMPLEX64: return 8;
    case COMPLEX128: return 16;
    default: return 0;
  }
}

Comm* CommOpen(const std::string& name, int nranks, int rank) {
  if (nranks < 1 || nranks > kMaxRanks || rank < 0 || rank >= nranks) {
    std::fprintf(stderr, "xfw testcpu: %d ranks (rank %d) outside 1..%d\n", nranks, rank, kMaxRanks);
    return nullptr;
  }
  auto* c = new Comm;
  c->name = name;
  c->nranks = nranks;
  c->rank = rank;
  c->bytes = HeaderBytes() + size_t(nranks) * kSlotBytes + size_t(nranks) * nranks * kMailBytes;
  int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(c->bytes)) != 0) {
    std::perror("xfw testcpu: shm_open/ftruncate");
    if (fd >= 0) close(fd);
    delete c;
    return nullptr;
  }
  void* p = mmap(nullptr, c->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    std::perror("xfw testcpu: mmap");
    delete c;
    return nullptr;
  }
  c->hdr = static_cast<Header*>(p);  // zero-filled by ftruncate: every counter starts at 0
  c->slots = static_cast<char*>(p) + HeaderBytes();
  c->mailbox = c->slots + size_t(nranks) * kSlotBytes;
  // Everyone has mapped the segment once all have arrived: then the name can go, so that no
  // segment outlives the processes even when they crash later.
  c->hdr->opened.fetch_add(1);
  Barrier(c);
  if (rank == 0) shm_unlink(name.c_str());
  return c;
}

void CommClose(Comm* c) {
  if (!c) return;
  munmap(c->hdr, c->bytes);
  delete c;
}

void Barrier(Comm* c) {
  if (c->nranks == 1) return;
  Header* h = c->hdr;
  int gen = h->generation.load(std::memory_order_acquire);
  if (h->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == c->nranks) {
    h->arrived.store(0, std::memory_order_relaxed);
    h->generation.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  Waiter w("a barrier", c);
  while (h->generation.load(std::memory_order_acquire) == gen) w.Pause();
}

bool AllReduce(Comm* c, const void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op, int root) {
  size_t es = ElementSize(t);
  if (!es) return false;
  if (c->nranks == 1) {
    if (recv != send && (root < 0 || root == c->rank)) std::memmove(recv, send, count * es);
    if (op == AVG || op == SUM || op == MAX || op == MIN || op == PRODUCT) return true;
  }
  size_t per = kSlotBytes / es;
  const char* srcs[kMaxRanks];
  for (int r = 0; r < c->nranks; ++r) srcs[r] = Slot(c, r);
  for (size_t done = 0; done < count; done += per) {
    size_t n = std::min(per, count - done);
    std::memcpy(Slot(c, c->rank), static_cast<const char*>(send) + done * es, n * es);
    Barrier(c);
    bool ok = true;
    if (root < 0 || root == c->rank) ok = Reduce(t, static_cast<char*>(recv) + done * es, srcs, c->nranks, n, op);
    Barrier(c);
    if (!ok) return false;
  }
  return true;
}

bool Broadcast(Comm* c, void* buf, size_t count, C_DataType t, int root) {
  size_t es = ElementSize(t);
  if (!es) return false;
  if (c->nranks == 1) return true;
  size_t per = kSlotBytes / es;
  for (size_t done = 0; done < count; done += per) {
    size_t n = std::min(per, count - done);
    char* part = static_cast<char*>(buf) + done * es;
    if (c->rank == root) std::memcpy(Slot(c, root), part, n * es);
    Barrier(c);
    if (c->rank != root) std::memcpy(part, Slot(c, root), n * es);
    Barrier(c);
  }
  return true;
}

bool AllGather(Comm* c, const void* send, void* recv, size_t count, C_DataType t) {
  size_t es = ElementSize(t);
  if (!es) return false;
  size_t per = kSlotBytes / es;
  for (size_t done = 0; done < count || (count == 0 && done == 0); done += per) {
    size_t n = std::min(per, count - done);
    std::memcpy(Slot(c, c->rank), static_cast<const char*>(send) + done * es, n * es);
    Barrier(c);
    for (int r = 0; r < c->nranks; ++r)
      std::memcpy(static_cast<char*>(recv) + (size_t(r) * count + done) * es, Slot(c, r), n * es);
    Barrier(c);
    if (count == 0) break;
  }
  return true;
}

bool ReduceScatter(Comm* c, const void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op) {
  // send holds nranks blocks of `count`; rank r receives the reduction of every rank's block r.
  size_t es = ElementSize(t);
  if (!es) return false;
  size_t per = kSlotBytes / es / c->nranks;
  const char* srcs[kMaxRanks];
  for (size_t done = 0; done < count; done += per) {
    size_t n = std::min(per, count - done);
    char* mine = Slot(c, c->rank);
    for (int b = 0; b < c->nranks; ++b)
      std::memcpy(mine + size_t(b) * n * es, static_cast<const char*>(send) + (size_t(b) * count + done) * es, n * es);
    Barrier(c);
    for (int r = 0; r < c->nranks; ++r) srcs[r] = Slot(c, r) + size_t(c->rank) * n * es;
    bool ok = Reduce(t, static_cast<char*>(recv) + done * es, srcs, c->nranks, n, op);
    Barrier(c);
    if (!ok) return false;
  }
  return true;
}

bool Send(Comm* c, const void* buf, size_t count, C_DataType t, int peer) {
  size_t es = ElementSize(t), bytes = count * es;
  if (!es || peer < 0 || peer >= c->nranks) return false;
  char* box = c->mailbox + (size_t(c->rank) * c->nranks + peer) * kMailBytes;
  Header* h = c->hdr;
  size_t done = 0;
  do {
    Waiter w("send", c);
    while (h->posted[c->rank][peer].load(std::memory_order_acquire) !=
           h->taken[c->rank][peer].load(std::memory_order_acquire))
      w.Pause();
    size_t n = std::min(kMailBytes, bytes - done);
    std::memcpy(box, static_cast<const char*>(buf) + done, n);
    h->sizes[c->rank][peer].store(n, std::memory_order_relaxed);
    h->posted[c->rank][peer].fetch_add(1, std::memory_order_acq_rel);
    done += n;
  } while (done < bytes);
  return true;
}

bool Recv(Comm* c, void* buf, size_t count, C_DataType t, int peer) {
  size_t es = ElementSize(t), bytes = count * es;
  if (!es || peer < 0 || peer >= c->nranks) return false;
  char* box = c->mailbox + (size_t(peer) * c->nranks + c->rank) * kMailBytes;
  Header* h = c->hdr;
  size_t done = 0;
  do {
    Waiter w("recv", c);
    while (h->posted[peer][c->rank].load(std::memory_order_acquire) ==
           h->taken[peer][c->rank].load(std::memory_order_acquire))
      w.Pause();
    size_t n = h->sizes[peer][c->rank].load(std::memory_order_relaxed);
    std::memcpy(static_cast<char*>(buf) + done, box, n);
    h->taken[peer][c->rank].fetch_add(1, std::memory_order_acq_rel);
    done += n;
  } while (done < bytes);
  return true;
}

}  // namespace xfw_testcpu
