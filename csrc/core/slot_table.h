// SlotTable: the batch rows of one cache, their states, and the checks of slot arguments.
//
// Why a type of its own: every public call names slots or passes one length per slot, and every
// error about them must name the bad value and the limit the same way (DESIGN.md section 7). The
// table also decides which slot a new request gets (alloc, fork, swap-in) and keeps the orders
// (free order, step counter) the reclamation and eviction policies read.
//
// Not thread-safe: the owning cache serializes calls under its mutex.
#pragma once

#include <climits>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/slot.h"

namespace vattention {

class SlotTable {
 public:
  static constexpr int64_t kUnlisted = INT64_MIN;  // "leave this slot alone" in a lens vector

  SlotTable(int64_t max_batch, int64_t max_seq);

  size_t size() const { return slots_.size(); }
  Slot& operator[](size_t i) { return slots_[i]; }
  const Slot& operator[](size_t i) const { return slots_[i]; }
  std::vector<Slot>::iterator begin() { return slots_.begin(); }
  std::vector<Slot>::iterator end() { return slots_.end(); }
  std::vector<Slot>::const_iterator begin() const { return slots_.begin(); }
  std::vector<Slot>::const_iterator end() const { return slots_.end(); }

  // Throws InvalidSlot naming the slot and the range unless 0 <= slot < max_batch.
  void validate(int64_t slot) const;
  // Throws InvalidSlot "<role>=<slot> <why>" unless the slot is in range and active.
  void require_active(int slot, const char* role, const char* why) const;
  // Checks a lens vector (max_batch entries, kUnlisted for slots left alone): lengths within
  // [0, max_seq] (SequenceTooLong) and, with require_active, only active slots listed.
  void validate_lens(const std::vector<int64_t>& lens, bool require_active) const;
  Error no_free_slot() const;

  // For a new request: the idle slot holding the most pages, else a free one (deferred
  // reclamation: the request inherits mapped memory). With `kept` (pages an idle slot already maps
  // as the request needs them), the idle slot where it is largest comes first, the most pages
  // breaking ties. Throws InvalidSlot when all are active.
  int pick_for_alloc(const std::function<size_t(const Slot&)>& kept = {}) const;
  // For a slot about to be filled from elsewhere (fork, swap-in): a free slot (nothing to unmap),
  // else the least recently freed idle one. Throws InvalidSlot when all are active.
  int pick_fresh() const;
  std::vector<int> active() const;

  // Orders: free() order for least-recently-freed-first reclamation; step() count for eviction.
  uint64_t next_free_order() { return ++free_counter_; }
  uint64_t step_count() const { return step_counter_; }
  // Records a step's lengths for every listed slot and advances the step counter.
  void commit(const std::vector<int64_t>& lens);

 private:
  const int64_t max_batch_;
  const int64_t max_seq_;
  std::vector<Slot> slots_;
  uint64_t free_counter_ = 0;
  uint64_t step_counter_ = 0;
};

}  // namespace vattention
