// SlotTable: the batch rows of one cache, who holds them, and the checks of slot arguments.
//
// Why a type of its own: every public call names slots or passes one length per slot, and every
// error about them must name the bad value and the limit the same way. The table also decides
// which slot a new request gets (alloc, fork, swap-in) and keeps the orders (free order, step
// counter) the reclamation and eviction policies read.
//
// It stores the slot records (slot.h) and is the only writer of their SlotUse part: whether a
// request holds a row and its length change only through activate(), deactivate() and the
// length operations below. The SlotPages part is SlotMemory's (slot_memory.h); everyone else
// reads both through const views.
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
  const Slot& operator[](size_t i) const { return slots_[i]; }
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
  // reclamation: the request inherits mapped memory). With `kept` (pages idle slot i already maps
  // as the request needs them), the idle slot where it is largest comes first, the most pages
  // breaking ties. Throws InvalidSlot when all are active.
  int pick_for_alloc(const std::function<size_t(int)>& kept = {}) const;
  // For a slot about to be filled from elsewhere (fork, swap-in): a free slot (nothing to unmap),
  // else the least recently freed idle one. Throws InvalidSlot when all are active.
  int pick_fresh() const;
  std::vector<int> active() const;

  // ---- who holds a row (SlotUse) ------------------------------------------------------------
  // A request takes `slot` with `seq_len` tokens (alloc: 0; fork, swap-in: the tokens it brings).
  void activate(int slot, int64_t seq_len);
  // The request in `slot` ended (free, swap-out): the row keeps whatever pages it maps (idle).
  void deactivate(int slot);
  // Records a step's lengths for every listed slot and advances the step counter.
  void commit(const std::vector<int64_t>& lens);
  // A step's new lengths, before its pages are mapped, so that trimming look-ahead under pressure
  // keeps them: every listed slot's length becomes max(old, new). Returns every slot's old length
  // for restore_lengths() when the step fails.
  std::vector<int64_t> raise_lengths(const std::vector<int64_t>& lens);
  void restore_lengths(const std::vector<int64_t>& old_lens);
  // Lowers `slot`'s length to at most `tokens` (a failed step that unmapped part of its row).
  void limit_length(int slot, int64_t tokens);

  // The one mutable path to a row's SlotPages: only SlotMemory, their writer, can make the key.
  class PagesKey {
    friend class SlotMemory;
    PagesKey() = default;
  };
  SlotPages& pages_of(size_t i, PagesKey /*key*/) { return slots_[i].pages; }

 private:
  const int64_t max_batch_;
  const int64_t max_seq_;
  std::vector<Slot> slots_;
  uint64_t free_counter_ = 0;
  uint64_t step_counter_ = 0;
};

}  // namespace vattention
