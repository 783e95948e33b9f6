// Loads the CUDA driver at run time and checks every CUresult (see cuda_driver.h for why).
#ifdef VATTENTION_WITH_CUDA

#include "cuda/cuda_driver.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/errors.h"

namespace vattention::cuda {
namespace {

struct Loaded {
  DriverApi api;
  std::string error;  // non-empty: why the driver is unavailable
};

using GetProcV2 = CUresult (*)(const char*, void**, int, cuuint64_t,
                               CUdriverProcAddressQueryResult*);
using GetProcV1 = CUresult (*)(const char*, void**, int, cuuint64_t);

std::string version_text(int v) {
  return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
}

Loaded load() {
  Loaded l;
  const char* env = std::getenv("VATTENTION_LIBCUDA");
  const bool from_env = env != nullptr && *env != '\0';
  l.api.library_path = from_env ? env : "libcuda.so.1";
  // RTLD_LOCAL: the driver's symbols must not satisfy anyone else's undefined references.
  void* lib = dlopen(l.api.library_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    l.error =
        "cannot load the CUDA driver library '" + l.api.library_path +
        "': " + (why ? why : "unknown dlopen error") +
        (from_env ? " (path from VATTENTION_LIBCUDA)"
                  : " (is an NVIDIA driver installed? VATTENTION_LIBCUDA overrides the path)");
    return l;
  }
  // Deliberately never dlclose()d: the driver cannot be unloaded safely while the process lives.
  auto v2 = reinterpret_cast<GetProcV2>(dlsym(lib, "cuGetProcAddress_v2"));
  auto v1 = v2 ? nullptr : reinterpret_cast<GetProcV1>(dlsym(lib, "cuGetProcAddress"));
  if (v2 == nullptr && v1 == nullptr) {
    l.error = l.api.library_path +
              " exports neither cuGetProcAddress_v2 nor cuGetProcAddress (driver older than CUDA "
              "11.3?)";
    return l;
  }
  auto resolve = [&](const char* name, int version, void** out) {
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
    // LEGACY_STREAM: stream 0 means the legacy default stream, as torch's default stream does.
    CUresult r = v2 ? v2(name, out, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &status)
                    : v1(name, out, version, CU_GET_PROC_ADDRESS_LEGACY_STREAM);
    if (r == CUDA_SUCCESS && *out != nullptr) return true;
    l.error = l.api.library_path + " does not provide " + name + " for CUDA " +
              version_text(version) + " (cuGetProcAddress returned " + std::to_string(int(r)) +
              (status == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT ? ", version not sufficient"
               : status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND     ? ", symbol not found"
                                                                    : "") +
              ")";
    *out = nullptr;
    return false;
  };
  // #name is the base name (stringizing does not expand cuda.h's _v2 renaming macros).
#define VATTENTION_CUDA_RESOLVE(name, version) \
  if (!resolve(#name, version, reinterpret_cast<void**>(&l.api.name))) return l;
  VATTENTION_CUDA_DRIVER_ENTRIES(VATTENTION_CUDA_RESOLVE)
#undef VATTENTION_CUDA_RESOLVE
  if (l.api.cuDriverGetVersion(&l.api.driver_version) != CUDA_SUCCESS) l.api.driver_version = 0;
  return l;
}

const Loaded& loaded() {
  static const Loaded l = load();  // thread-safe one-time initialisation
  return l;
}

bool is_address(const char* key) {
  return std::strstr(key, "va") != nullptr || std::strstr(key, "addr") != nullptr ||
         std::strstr(key, "ptr") != nullptr || std::strstr(key, "stream") != nullptr ||
         std::strstr(key, "event") != nullptr || std::strstr(key, "handle") != nullptr;
}

}  // namespace

const DriverApi& driver() {
  const Loaded& l = loaded();
  if (!l.error.empty())
    throw Error(Error::Kind::Unavailable, "CUDA backend unavailable: " + l.error);
  return l.api;
}

std::string driver_unavailable_reason() {
  try {
    return loaded().error;
  } catch (const std::exception& e) {  // load() itself only allocates; be safe anyway
    return e.what();
  }
}

std::string describe(CUresult result) {
  const char* name = nullptr;
  const char* text = nullptr;
  const Loaded& l = loaded();
  if (l.error.empty()) {
    if (l.api.cuGetErrorName(result, &name) != CUDA_SUCCESS) name = nullptr;
    if (l.api.cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  }
  std::string out = name ? name : "CUresult";
  out += " (" + std::to_string(int(result)) + ")";
  if (text) out += std::string(": ") + text;
  return out;
}

void check(CUresult result, const char* call, std::initializer_list<Arg> args) {
  if (result == CUDA_SUCCESS) return;
  std::string msg = std::string(call) + "(";
  bool first = true;
  for (const Arg& a : args) {
    char buf[64];
    if (is_address(a.first)) {
      std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(a.second));
    } else {
      std::snprintf(buf, sizeof buf, "%llu", static_cast<unsigned long long>(a.second));
    }
    msg += (first ? "" : ", ") + std::string(a.first) + "=" + buf;
    first = false;
  }
  const char* text = nullptr;
  const Loaded& l = loaded();
  if (l.error.empty() && l.api.cuGetErrorString(result, &text) != CUDA_SUCCESS) text = nullptr;
  msg += ") failed: " + describe(result);
  Error err(Error::Kind::Driver, msg);
  err.with("call", std::string(call))
      .with("code", static_cast<int64_t>(result))
      .with("error_string", std::string(text ? text : "unknown CUresult"));
  for (const Arg& a : args) err.with(a.first, static_cast<int64_t>(a.second));
  throw err;
}

}  // namespace vattention::cuda

#endif  // VATTENTION_WITH_CUDA
