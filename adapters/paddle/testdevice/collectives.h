// Collectives of the xfw CPU test device across processes, through POSIX shared memory.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "paddle/phi/backends/device_ext.h"

namespace xfw_testcpu {

constexpr int kMaxRanks = 8;

struct Header;  // lives in the shared segment (collectives.cc)

struct Comm {
  std::string name;
  int nranks = 0;
  int rank = 0;
  size_t bytes = 0;
  Header* hdr = nullptr;
  char* slots = nullptr;    // nranks slots of kSlotBytes: what each rank contributes
  char* mailbox = nullptr;  // nranks*nranks mailboxes of kMailBytes for send/recv
};

Comm* CommOpen(const std::string& name, int nranks, int rank);
void CommClose(Comm* c);
void Barrier(Comm* c);
// root < 0: every rank receives the result (all_reduce); root >= 0: only root does (reduce).
bool AllReduce(Comm* c, const void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op, int root);
bool Broadcast(Comm* c, void* buf, size_t count, C_DataType t, int root);
bool AllGather(Comm* c, const void* send, void* recv, size_t count, C_DataType t);
bool ReduceScatter(Comm* c, const void* send, void* recv, size_t count, C_DataType t, C_CCLReduceOp op);
bool Send(Comm* c, const void* buf, size_t count, C_DataType t, int peer);
bool Recv(Comm* c, void* buf, size_t count, C_DataType t, int peer);
size_t ElementSize(C_DataType t);

}  // namespace xfw_testcpu
