// Which sanitizer a C++ test binary was built with, for its result lines: `make sanitize` builds
// each test under ThreadSanitizer and under AddressSanitizer/UBSan, and the two runs must say
// which is which. (gcc defines __SANITIZE_THREAD__/__SANITIZE_ADDRESS__; clang answers
// __has_feature.)
#pragma once

#if defined(__SANITIZE_THREAD__)
#define VATTENTION_TEST_TSAN 1
#elif defined(__SANITIZE_ADDRESS__)
#define VATTENTION_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define VATTENTION_TEST_TSAN 1
#elif __has_feature(address_sanitizer)
#define VATTENTION_TEST_ASAN 1
#endif
#endif

namespace vattention {
namespace testing {

inline const char* sanitizer_name() {
#if defined(VATTENTION_TEST_TSAN)
  return "ThreadSanitizer";
#elif defined(VATTENTION_TEST_ASAN)
  return "AddressSanitizer+UBSan";
#else
  return "no sanitizer";
#endif
}

}  // namespace testing
}  // namespace vattention
