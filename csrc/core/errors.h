// Typed C++ exceptions for the core. bindings.cpp translates each Kind into the matching Python
// class of vattention.errors, copying the integer and string fields onto the exception object so
// callers can react to numbers (pages_needed, pages_free, ...) instead of parsing messages.
#pragma once

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace vattention {

class Error : public std::runtime_error {
 public:
  enum class Kind {
    Config,          // bad configuration value           -> ConfigError(ValueError)
    InvalidSlot,     // slot out of range / not allocated  -> InvalidSlotError(ValueError)
    SequenceTooLong, // length outside [0, max_seq_len]    -> SequenceTooLongError(ValueError)
    OutOfPages,      // physical pages exhausted           -> OutOfPagesError(MemoryError)
    Driver,          // backend/driver call failed         -> DriverError(RuntimeError)
    Unavailable,     // backend cannot run here            -> BackendUnavailableError
    Closed,          // use after close()                  -> CacheClosedError
    SwapSpace,       // swap host-memory budget exceeded   -> SwapSpaceError(MemoryError)
    UnmappedRead,    // a read past a row's mapped tokens  -> UnmappedReadError(ValueError)
  };

  Error(Kind kind, std::string message) : std::runtime_error(std::move(message)), kind_(kind) {}

  Kind kind() const { return kind_; }
  Error& with(const std::string& key, int64_t value) {
    ints_[key] = value;
    return *this;
  }
  Error& with(const std::string& key, std::string value) {
    strs_[key] = std::move(value);
    return *this;
  }
  const std::map<std::string, int64_t>& ints() const { return ints_; }
  const std::map<std::string, std::string>& strs() const { return strs_; }

 private:
  Kind kind_;
  std::map<std::string, int64_t> ints_;
  std::map<std::string, std::string> strs_;
};

}  // namespace vattention
