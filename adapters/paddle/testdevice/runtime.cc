// xfw CPU test device for Paddle: the runtime half (device, memory, streams, events, collectives).
// Device memory is ordinary host memory; every "asynchronous" call completes before it returns,
// so streams and events only have to exist. Collectives are real and cross processes: the ranks of
// one communicator share a POSIX shared-memory segment named after the unique id Paddle hands every
// rank, and meet at a barrier built on atomics in that segment (see collectives.h).
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>

#include "collectives.h"
#include "paddle/phi/backends/device_ext.h"

namespace {

constexpr int kDeviceCount = 8;  // how many ranks one host may start (nproc_per_node <= 8)
thread_local int current_device = 0;

C_Status Ok() { return C_SUCCESS; }

C_Status Initialize() { return C_SUCCESS; }
C_Status Finalize() { return C_SUCCESS; }
C_Status InitDevice(const C_Device d) { current_device = d->id; return C_SUCCESS; }
C_Status SetDevice(const C_Device d) { current_device = d->id; return C_SUCCESS; }
C_Status GetDevice(const C_Device d) { d->id = current_device; return C_SUCCESS; }
C_Status DeinitDevice(const C_Device) { return C_SUCCESS; }

C_Status GetDeviceCount(size_t* count) { *count = kDeviceCount; return C_SUCCESS; }
C_Status GetDeviceList(size_t* devices) {
  for (int i = 0; i < kDeviceCount; ++i) devices[i] = i;
  return C_SUCCESS;
}

// Streams and events are tokens (never dereferenced, never freed): the work they would order has
// already happened when a call returns.
std::atomic<uintptr_t> next_token{1};
template <typename H>
H Token() { return reinterpret_cast<H>(next_token.fetch_add(1) * 64); }
C_Status CreateStream(const C_Device, C_Stream* s) { *s = Token<C_Stream>(); return C_SUCCESS; }
C_Status DestroyStream(const C_Device, C_Stream) { return C_SUCCESS; }
C_Status CreateEvent(const C_Device, C_Event* e) { *e = Token<C_Event>(); return C_SUCCESS; }
C_Status DestroyEvent(const C_Device, C_Event) { return C_SUCCESS; }
C_Status RecordEvent(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }
C_Status QueryEvent(const C_Device, C_Event) { return C_SUCCESS; }
C_Status QueryStream(const C_Device, C_Stream) { return C_SUCCESS; }
C_Status SyncDevice(const C_Device) { return C_SUCCESS; }
C_Status SyncStream(const C_Device, C_Stream) { return C_SUCCESS; }
C_Status SyncEvent(const C_Device, C_Event) { return C_SUCCESS; }
C_Status StreamWaitEvent(const C_Device, C_Stream, C_Event) { return C_SUCCESS; }

C_Status Copy(const C_Device, void* dst, const void* src, size_t size) {
  if (size && dst != src) std::memmove(dst, src, size);
  return C_SUCCESS;
}
C_Status AsyncCopy(const C_Device d, C_Stream, void* dst, const void* src, size_t size) {
  return Copy(d, dst, src, size);
}
C_Status CopyP2P(const C_Device, const C_Device d, void* dst, const void* src, size_t size) {
  return Copy(d, dst, src, size);
}
C_Status AsyncCopyP2P(const C_Device, const C_Device d, C_Stream, void* dst, const void* src, size_t size) {
  return Copy(d, dst, src, size);
}

// XFW_TESTCPU_FILL=zero|nan fills every fresh device allocation (nan: 0xff bytes, a NaN in every
// floating type): a debugging aid that shows whether a computation reads memory nothing wrote.
int FillByte() {
  static int fill = [] {
    const char* v = std::getenv("XFW_TESTCPU_FILL");
    if (!v) return -1;
    if (!std::strcmp(v, "zero")) return 0;
    if (!std::strcmp(v, "nan")) return 0xff;
    return -1;
  }();
  return fill;
}

C_Status Allocate(const C_Device, void** ptr, size_t size) {
  size_t rounded = ((size ? size : 1) + 63) / 64 * 64;
  *ptr = std::aligned_alloc(64, rounded);
  if (*ptr && FillByte() >= 0) std::memset(*ptr, FillByte(), rounded);
  return *ptr ? C_SUCCESS : C_FAILED;
}
C_Status Deallocate(const C_Device, void* ptr, size_t) { std::free(ptr); return C_SUCCESS; }

C_Status MemStats(const C_Device, size_t* total, size_t* free_bytes) {
  // Report a fixed 16 GiB device: the allocator only needs a plausible budget.
  *total = size_t(16) << 30;
  *free_bytes = size_t(8) << 30;
  return C_SUCCESS;
}
C_Status MinChunk(const C_Device, size_t* size) { *size = 512; return C_SUCCESS; }

// ---- collectives -------------------------------------------------------------------------------
C_Status UniqueIdSize(size_t* sz) { *sz = 64; return C_SUCCESS; }
C_Status UniqueId(C_CCLRootId* id) {
  std::random_device rd;
  char name[64];
  std::snprintf(name, sizeof(name), "/xfw-testcpu-%d-%08x%08x", static_cast<int>(getpid()), rd(), rd());
  std::memset(id->data, 0, id->sz);
  std::strncpy(static_cast<char*>(id->data), name, id->sz - 1);
  return C_SUCCESS;
}
C_Status CommInit(size_t nranks, C_CCLRootId* id, size_t rank, C_CCLComm* comm) {
  std::string name(static_cast<char*>(id->data), strnlen(static_cast<char*>(id->data), id->sz));
  auto* c = xfw_testcpu::CommOpen(name, static_cast<int>(nranks), static_cast<int>(rank));
  if (!c) return C_FAILED;
  *comm = reinterpret_cast<C_CCLComm>(c);
  return C_SUCCESS;
}
xfw_testcpu::Comm* AsComm(C_CCLComm c) { return reinterpret_cast<xfw_testcpu::Comm*>(c); }
C_Status CommDestroy(C_CCLComm comm) { xfw_testcpu::CommClose(AsComm(comm)); return C_SUCCESS; }
C_Status CommName(C_CCLComm comm, char* name) {
  std::strcpy(name, AsComm(comm)->name.c_str());
  return C_SUCCESS;
}
C_Status Status(bool ok) { return ok ? C_SUCCESS : C_ERROR; }
C_Status AllReduce(void* s, void* r, size_t n, C_DataType t, C_CCLReduceOp op, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::AllReduce(AsComm(c), s, r, n, t, op, -1));
}
C_Status Reduce(void* s, void* r, size_t n, C_DataType t, C_CCLReduceOp op, size_t root, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::AllReduce(AsComm(c), s, r, n, t, op, static_cast<int>(root)));
}
C_Status Broadcast(void* b, size_t n, C_DataType t, size_t root, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::Broadcast(AsComm(c), b, n, t, static_cast<int>(root)));
}
C_Status AllGather(void* s, void* r, size_t n, C_DataType t, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::AllGather(AsComm(c), s, r, n, t));
}
C_Status ReduceScatter(void* s, void* r, size_t n, C_DataType t, C_CCLReduceOp op, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::ReduceScatter(AsComm(c), s, r, n, t, op));
}
C_Status Send(void* b, size_t n, C_DataType t, size_t peer, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::Send(AsComm(c), b, n, t, static_cast<int>(peer)));
}
C_Status Recv(void* b, size_t n, C_DataType t, size_t peer, C_CCLComm c, C_Stream) {
  return Status(xfw_testcpu::Recv(AsComm(c), b, n, t, static_cast<int>(peer)));
}
C_Status GroupStart() { return C_SUCCESS; }
C_Status GroupEnd() { return C_SUCCESS; }

C_Status ProfInit(C_Profiler, void**) { return C_SUCCESS; }
C_Status ProfFin(C_Profiler, void*) { return C_SUCCESS; }
C_Status ProfPrep(C_Profiler, void*) { return C_SUCCESS; }
C_Status ProfStart(C_Profiler, void*) { return C_SUCCESS; }
C_Status ProfStop(C_Profiler, void*) { return C_SUCCESS; }
C_Status ProfCollect(C_Profiler, uint64_t, void*) { return C_SUCCESS; }

}  // namespace

extern "C" __attribute__((visibility("default"))) void InitPlugin(CustomRuntimeParams* params) {
  PADDLE_CUSTOM_RUNTIME_CHECK_VERSION(params);
  params->device_type = const_cast<char*>("testcpu");
  params->sub_device_type = const_cast<char*>("xfw-v1");
  C_DeviceInterface* f = params->interface;
  std::memset(reinterpret_cast<void*>(f), 0, sizeof(C_DeviceInterface));
  f->size = sizeof(C_DeviceInterface);
  f->initialize = Initialize;
  f->finalize = Finalize;
  f->init_device = InitDevice;
  f->set_device = SetDevice;
  f->get_device = GetDevice;
  f->deinit_device = DeinitDevice;
  f->create_stream = CreateStream;
  f->destroy_stream = DestroyStream;
  f->create_event = CreateEvent;
  f->destroy_event = DestroyEvent;
  f->record_event = RecordEvent;
  f->query_event = QueryEvent;
  f->query_stream = QueryStream;
  f->synchronize_device = SyncDevice;
  f->synchronize_stream = SyncStream;
  f->synchronize_event = SyncEvent;
  f->stream_wait_event = StreamWaitEvent;
  f->memory_copy_h2d = Copy;
  f->memory_copy_d2d = Copy;
  f->memory_copy_d2h = Copy;
  f->memory_copy_p2p = CopyP2P;
  f->async_memory_copy_h2d = AsyncCopy;
  f->async_memory_copy_d2d = AsyncCopy;
  f->async_memory_copy_d2h = AsyncCopy;
  f->async_memory_copy_p2p = AsyncCopyP2P;
  f->device_memory_allocate = Allocate;
  f->host_memory_allocate = Allocate;
  f->unified_memory_allocate = Allocate;
  f->device_memory_deallocate = Deallocate;
  f->host_memory_deallocate = Deallocate;
  f->unified_memory_deallocate = Deallocate;
  f->get_device_count = GetDeviceCount;
  f->get_device_list = GetDeviceList;
  f->device_memory_stats = MemStats;
  f->device_min_chunk_size = MinChunk;
  f->xccl_get_comm_name = CommName;
  f->xccl_get_unique_id_size = UniqueIdSize;
  f->xccl_get_unique_id = UniqueId;
  f->xccl_comm_init_rank = CommInit;
  f->xccl_destroy_comm = CommDestroy;
  f->xccl_all_reduce = AllReduce;
  f->xccl_broadcast = Broadcast;
  f->xccl_reduce = Reduce;
  f->xccl_all_gather = AllGather;
  f->xccl_reduce_scatter = ReduceScatter;
  f->xccl_group_start = GroupStart;
  f->xccl_group_end = GroupEnd;
  f->xccl_send = Send;
  f->xccl_recv = Recv;
  f->profiler_initialize = ProfInit;
  f->profiler_finalize = ProfFin;
  f->profiler_prepare_tracing = ProfPrep;
  f->profiler_start_tracing = ProfStart;
  f->profiler_stop_tracing = ProfStop;
  f->profiler_collect_trace_data = ProfCollect;
  (void)Ok;
}
