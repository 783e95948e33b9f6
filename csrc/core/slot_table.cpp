#include "core/slot_table.h"

#include <algorithm>

namespace vattention {
namespace {

std::string slot_range(int64_t max_batch) { return "[0, " + std::to_string(max_batch) + ")"; }

}  // namespace

SlotTable::SlotTable(int64_t max_batch, int64_t max_seq)
    : max_batch_(max_batch), max_seq_(max_seq), slots_(static_cast<size_t>(max_batch)) {}

void SlotTable::validate(int64_t slot) const {
  if (slot < 0 || slot >= max_batch_) {
    throw Error(Error::Kind::InvalidSlot,
                "slot=" + std::to_string(slot) + " is out of range " + slot_range(max_batch_) +
                    " (max_batch_size=" + std::to_string(max_batch_) + ")")
        .with("slot", slot)
        .with("max_batch_size", max_batch_);
  }
}

void SlotTable::require_active(int slot, const char* role, const char* why) const {
  validate(slot);
  if (!slots_[static_cast<size_t>(slot)].use.active()) {
    throw Error(Error::Kind::InvalidSlot,
                std::string(role) + "=" + std::to_string(slot) + " " + why)
        .with("slot", slot);
  }
}

Error SlotTable::no_free_slot() const {
  return Error(Error::Kind::InvalidSlot,
               "no free slot: all max_batch_size=" + std::to_string(max_batch_) +
                   " slots are active; free one first")
      .with("max_batch_size", max_batch_);
}

void SlotTable::validate_lens(const std::vector<int64_t>& lens, bool require_active) const {
  if (static_cast<int64_t>(lens.size()) != max_batch_) {
    throw Error(Error::Kind::InvalidSlot,
                "seq_lens has " + std::to_string(lens.size()) +
                    " entries; a sequence must have max_batch_size=" + std::to_string(max_batch_));
  }
  for (size_t i = 0; i < lens.size(); ++i) {
    const int64_t len = lens[i];
    if (len == kUnlisted) continue;
    if (len < 0 || len > max_seq_) {
      throw Error(Error::Kind::SequenceTooLong,
                  "seq_lens[slot=" + std::to_string(i) + "]=" + std::to_string(len) +
                      (len < 0 ? " is negative" : " exceeds max_seq_len") +
                      "; lengths must be in [0, " + std::to_string(max_seq_) +
                      "] (max_seq_len=" + std::to_string(max_seq_) + ")")
          .with("slot", static_cast<int64_t>(i))
          .with("seq_len", len)
          .with("max_seq_len", max_seq_);
    }
    if (require_active && !slots_[i].use.active()) {
      throw Error(Error::Kind::InvalidSlot, "slot=" + std::to_string(i) + " has length " +
                                                std::to_string(len) +
                                                " but is not allocated (call alloc() first)")
          .with("slot", static_cast<int64_t>(i));
    }
  }
}

int SlotTable::pick_for_alloc(const std::function<size_t(int)>& kept) const {
  int best = -1;
  size_t best_kept = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state() == Slot::State::Idle) {
      const size_t k = kept ? kept(static_cast<int>(i)) : 0;
      const Slot* b = best < 0 ? nullptr : &slots_[static_cast<size_t>(best)];
      if (!b || b->state() != Slot::State::Idle || k > best_kept ||
          (k == best_kept && s.pages.mapped() > b->pages.mapped())) {
        best = static_cast<int>(i);
        best_kept = k;
      }
    } else if (s.state() == Slot::State::Free && best < 0) {
      best = static_cast<int>(i);
    }
  }
  if (best < 0) throw no_free_slot();
  return best;
}

int SlotTable::pick_fresh() const {
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.state() == Slot::State::Free) return static_cast<int>(i);
    if (s.state() == Slot::State::Idle &&
        (best < 0 || s.use.freed_at() < slots_[static_cast<size_t>(best)].use.freed_at())) {
      best = static_cast<int>(i);
    }
  }
  if (best < 0) throw no_free_slot();
  return best;
}

std::vector<int> SlotTable::active() const {
  std::vector<int> out;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].use.active()) out.push_back(static_cast<int>(i));
  }
  return out;
}

void SlotTable::activate(int slot, int64_t seq_len) {
  SlotUse& u = slots_[static_cast<size_t>(slot)].use;
  u.active_ = true;
  u.seq_len_ = seq_len;
  u.last_step_ = step_counter_;
}

void SlotTable::deactivate(int slot) {
  SlotUse& u = slots_[static_cast<size_t>(slot)].use;
  u.active_ = false;
  u.seq_len_ = 0;
  u.freed_at_ = ++free_counter_;
}

void SlotTable::commit(const std::vector<int64_t>& lens) {
  ++step_counter_;
  for (size_t i = 0; i < lens.size(); ++i) {
    if (lens[i] == kUnlisted) continue;
    slots_[i].use.seq_len_ = lens[i];
    slots_[i].use.last_step_ = step_counter_;
  }
}

std::vector<int64_t> SlotTable::raise_lengths(const std::vector<int64_t>& lens) {
  std::vector<int64_t> old(slots_.size());
  for (size_t i = 0; i < slots_.size(); ++i) {
    SlotUse& u = slots_[i].use;
    old[i] = u.seq_len_;
    if (i < lens.size() && lens[i] != kUnlisted) u.seq_len_ = std::max(lens[i], old[i]);
  }
  return old;
}

void SlotTable::restore_lengths(const std::vector<int64_t>& old_lens) {
  for (size_t i = 0; i < slots_.size(); ++i) slots_[i].use.seq_len_ = old_lens[i];
}

void SlotTable::limit_length(int slot, int64_t tokens) {
  SlotUse& u = slots_[static_cast<size_t>(slot)].use;
  u.seq_len_ = std::min(u.seq_len_, tokens);
}

}  // namespace vattention
