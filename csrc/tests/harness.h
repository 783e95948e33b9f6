// The C++ tests' shared harness: checks that count failures (from any thread) and the exit code
// that reports them. Each test binary is built under ThreadSanitizer and AddressSanitizer/UBSan
// by `make sanitize`; a failure or a sanitizer report fails the run.
#pragma once

#include <atomic>
#include <cstdio>
#include <string>

namespace vattention {
namespace testing {

inline std::atomic<int>& failures() {
  static std::atomic<int> count{0};
  return count;
}

// Records a failure (and prints it) unless ok.
inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++failures();
  }
}

// main()'s return value: prints the outcome of the binary named `suite`.
inline int report(const char* suite) {
  if (failures() != 0) {
    std::fprintf(stderr, "%s: %d failure(s)\n", suite, failures().load());
    return 1;
  }
  std::printf("%s: all passed\n", suite);
  return 0;
}

}  // namespace testing
}  // namespace vattention
