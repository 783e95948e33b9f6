// FaultReport: turns a bare SIGSEGV/SIGBUS on a host-backend KV tensor into a diagnostic.
//
// Why: a cache tensor is a dense [B, S, H, D] view of a virtual range in which only the tokens
// step() asked for are backed by pages. Reading k[slot, 5000] beyond the mapped length, printing a
// whole layer tensor, or using a tensor after close() touches PROT_NONE memory and the process
// dies with "Segmentation fault" and nothing else. A fatal-signal handler, installed with the
// first host cache, checks whether the faulting address lies in a registered reservation; if so it
// writes which cache, tensor (K/V, layer), slot and token was touched and what to do, then puts the
// previous handler back and returns, so the access faults again into it (Python's faulthandler
// traceback, or the default action: the process dies of the signal, exit status non-zero). A
// fault anywhere else goes straight to the previous handler: the handler only adds a message.
//
// Signal safety: the handler reads a fixed table of atomic pointers to immutable records (plus one
// atomic "closed" flag each), formats with its own integer printer, and writes with write(2).
// Registration and removal take a mutex (never from the handler). A record is freed only after
// being unpublished; a fault racing the destruction of its very cache may read a stale record
// (the message may then be missing, never wrong about another cache's memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/backend.h"

namespace vattention {

struct FaultRegion;  // fault_report.cpp

// The geometry the handler needs to name a position; sizes in bytes.
struct FaultGeometry {
  int64_t num_layers = 0;
  int64_t max_batch = 0;
  int64_t max_seq = 0;
  bool mega = false;
  std::vector<size_t> slot_bytes;  // per tensor: row stride
  std::vector<size_t> token_bytes;  // per tensor: token stride within a row
  size_t layer_bytes = 0;  // mega: one layer of one token (layer stride within a token)
  std::vector<size_t> tensor_bytes;  // per tensor: the reservation's length
};

// One registered cache. Registers on construction (installing the handler once per process),
// unregisters on destruction. Not copyable.
class FaultReport final : public Backend::CacheRegistration {
 public:
  FaultReport(const FaultGeometry& geometry, const std::vector<uintptr_t>& bases);
  ~FaultReport() override;
  FaultReport(const FaultReport&) = delete;
  FaultReport& operator=(const FaultReport&) = delete;
  // After close(): a fault in this cache says the cache is closed.
  void mark_closed() override;

 private:
  FaultRegion* region_;
  int index_ = -1;  // slot in the table; -1 if the table was full (no message then)
};

}  // namespace vattention
