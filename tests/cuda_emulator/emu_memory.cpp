// EMULATION, TEST-ONLY: the VMM entry points (cuMemAddressReserve/Free, cuMemCreate/Release,
// cuMemMap/Unmap, cuMemSetAccess, cuMemGetAllocationGranularity, cuMemGetInfo) backed by host
// memory.
//
// Model: a reservation is an mmap(PROT_NONE) range aligned to the granularity; a handle is a memfd
// of its size (so one handle mapped at several addresses aliases the same bytes); cuMemMap puts
// the memfd at the address with PROT_NONE, and only cuMemSetAccess makes it read/write, so touching
// mapped-but-not-accessible memory really faults, as on the GPU. Each documented rule that the code
// could break returns the driver's error code AND counts a violation (README.md lists the rules).
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "emu_state.h"

namespace {

using emu::Call;
using emu::state;

bool aligned(uint64_t v, size_t g) { return g != 0 && v % g == 0; }

// Reservation wholly containing [ptr, ptr + size), or end().
std::map<uintptr_t, emu::Reservation>::iterator containing_reservation(uintptr_t ptr, size_t size) {
  auto& rs = state().reservations;
  auto it = rs.upper_bound(ptr);
  if (it == rs.begin()) return rs.end();
  --it;
  if (ptr >= it->first && ptr + size <= it->first + it->second.size) return it;
  return rs.end();
}

bool overlaps_mapping(uintptr_t ptr, size_t size) {
  auto& ms = state().mappings;
  auto it = ms.lower_bound(ptr);
  if (it != ms.end() && it->first < ptr + size) return true;
  if (it != ms.begin()) {
    --it;
    if (it->first + it->second.size > ptr) return true;
  }
  return false;
}

// The mappings exactly tiling [ptr, ptr + size): first starts at ptr, each next one starts where
// the previous ends, the last ends at ptr + size. Empty if the range splits a mapping or has a
// hole.
std::vector<std::map<uintptr_t, emu::Mapping>::iterator> exact_mappings(uintptr_t ptr,
                                                                        size_t size) {
  std::vector<std::map<uintptr_t, emu::Mapping>::iterator> run;
  auto& ms = state().mappings;
  uintptr_t cur = ptr;
  auto it = ms.find(ptr);
  while (cur < ptr + size) {
    if (it == ms.end() || it->first != cur) return {};
    run.push_back(it);
    cur += it->second.size;
    ++it;
  }
  if (cur != ptr + size) return {};
  return run;
}

// Frees the memory of a released handle whose last mapping is gone. Freeing memory that work not
// yet complete reads is a violation (counted unless the caller already counted one for this call);
// the memory goes all the same, as on a GPU, where the kernel would then fault.
void free_handle_memory(Call& call, std::unordered_map<uint64_t, emu::Handle>::iterator it,
                        bool already_counted) {
  if (auto* u = emu::unit_using_handle(it->first); u != nullptr && !already_counted) {
    call.violation(CUDA_ERROR_INVALID_VALUE,
                   "%s frees the memory of handle 0x%llx that in-flight work on stream %s (unit "
                   "%llu, %s) may still read",
                   call.name(), static_cast<unsigned long long>(it->first),
                   emu::describe(u->second.stream).c_str(),
                   static_cast<unsigned long long>(u->first), u->second.what.c_str());
  }
  close(it->second.fd);
  state().bytes_in_use -= it->second.size;
  state().handles.erase(it);
}

CUresult check_prop(Call& call, const CUmemAllocationProp* prop) {
  if (prop == nullptr)
    return call.violation(CUDA_ERROR_INVALID_VALUE, "%s: prop is NULL", call.name());
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED)
    return call.violation(CUDA_ERROR_INVALID_VALUE, "%s: prop.type %d is not PINNED", call.name(),
                          int(prop->type));
  if (prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE)
    return call.violation(CUDA_ERROR_INVALID_VALUE, "%s: prop.location.type %d is not DEVICE",
                          call.name(), int(prop->location.type));
  if (!emu::device_valid(prop->location.id))
    return call.violation(CUDA_ERROR_INVALID_DEVICE, "%s: prop.location.id %d is not a device",
                          call.name(), prop->location.id);
  return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

CUresult cuMemGetAllocationGranularity(size_t* granularity, const CUmemAllocationProp* prop,
                                       CUmemAllocationGranularity_flags option) {
  EMU_ENTER("cuMemGetAllocationGranularity", emu::kInit);
  if (granularity == nullptr)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "granularity is NULL");
  if (CUresult r = check_prop(call_, prop); r != CUDA_SUCCESS) return r;
  if (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM && option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "granularity option %d", int(option));
  *granularity = state().granularity;
  return CUDA_SUCCESS;
}

// The device's free and total memory: the emulated budget (vaemu_set_device_memory_bytes) less
// what live handles hold, as a GPU's free memory falls by what cuMemCreate takes. cuda.h maps
// cuMemGetInfo to this name.
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  EMU_ENTER("cuMemGetInfo", emu::kInit | emu::kContext);
  if (free_bytes == nullptr || total_bytes == nullptr)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemGetInfo: free or total is NULL");
  const emu::State& s = state();
  *total_bytes = s.device_memory;
  *free_bytes = s.device_memory > s.bytes_in_use ? s.device_memory - s.bytes_in_use : 0;
  return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  EMU_ENTER("cuMemAddressReserve", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  (void)addr;  // a hint only; the driver may ignore it, and so do we
  size_t g = state().granularity;
  if (ptr == nullptr)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: ptr NULL");
  if (size == 0 || !aligned(size, g))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemAddressReserve: size %zu is not a positive multiple of the "
                           "granularity %zu",
                           size, g);
  if (alignment != 0 && (alignment & (alignment - 1)) != 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemAddressReserve: alignment %zu is not a power of two", alignment);
  if (flags != 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemAddressReserve: flags %llu != 0", flags);
  size_t align = alignment > g ? alignment : g;
  // Over-reserve, then trim, so the start is aligned as the driver's reservations are.
  void* raw =
      mmap(nullptr, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  uintptr_t start = (base + align - 1) / align * align;
  if (start > base) munmap(raw, start - base);
  uintptr_t tail = start + size;
  if (base + size + align > tail) munmap(reinterpret_cast<void*>(tail), base + size + align - tail);
  state().reservations[start] = emu::Reservation{size};
  *ptr = static_cast<CUdeviceptr>(start);
  return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  EMU_ENTER("cuMemAddressFree", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  auto& rs = state().reservations;
  auto it = rs.find(ptr);
  if (it == rs.end() || it->second.size != size)
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemAddressFree(0x%llx, %zu) is not exactly one reservation",
                           (unsigned long long)ptr, size);
  if (overlaps_mapping(ptr, size))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemAddressFree(0x%llx, %zu): the reservation still has live mappings",
                           (unsigned long long)ptr, size);
  munmap(reinterpret_cast<void*>(ptr), size);
  rs.erase(it);
  return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle* handle, size_t size,
                     const CUmemAllocationProp* prop, unsigned long long flags) {
  EMU_ENTER("cuMemCreate", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  emu::State& s = state();
  if (handle == nullptr)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: handle NULL");
  if (CUresult r = check_prop(call_, prop); r != CUDA_SUCCESS) return r;
  if (size == 0 || !aligned(size, s.granularity))
    return call_.violation(
        CUDA_ERROR_INVALID_VALUE,
        "cuMemCreate: size %zu is not a positive multiple of the granularity %zu", size,
        s.granularity);
  if (flags != 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemCreate: flags %llu != 0", flags);
  if (s.bytes_in_use + size > s.device_memory) return CUDA_ERROR_OUT_OF_MEMORY;  // not a misuse
  int fd = memfd_create("vaemu-device-memory", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    close(fd);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  uint64_t id = s.next_handle++;
  s.handles[id] = emu::Handle{fd, size, 0, false};
  s.bytes_in_use += size;
  *handle = id;
  return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
  EMU_ENTER("cuMemRelease", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  auto& hs = state().handles;
  auto it = hs.find(handle);
  if (it == hs.end() || it->second.released)
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemRelease(0x%llx): unknown handle or released twice",
                           (unsigned long long)handle);
  it->second.released = true;
  if (it->second.mappings == 0) free_handle_memory(call_, it, false);  // else at the last unmap
  return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
  EMU_ENTER("cuMemMap", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  emu::State& s = state();
  size_t g = s.granularity;
  unsigned long long p = ptr;
  if (size == 0 || !aligned(ptr, g) || !aligned(size, g))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemMap(0x%llx, %zu): address and size must be multiples of the "
                           "granularity %zu",
                           p, size, g);
  if (offset != 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: offset %zu must be 0", offset);
  if (flags != 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: flags %llu != 0", flags);
  auto h = s.handles.find(handle);
  if (h == s.handles.end() || h->second.released)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: handle 0x%llx unknown or released",
                           (unsigned long long)handle);
  if (size > h->second.size)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemMap: size %zu > handle size %zu", size,
                           h->second.size);
  if (containing_reservation(ptr, size) == s.reservations.end())
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemMap(0x%llx, %zu): range is not inside one reservation", p, size);
  if (overlaps_mapping(ptr, size))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemMap(0x%llx, %zu): range is already (partly) mapped", p, size);
  // No access until cuMemSetAccess: PROT_NONE, so a touch faults.
  void* got =
      mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->second.fd, 0);
  if (got == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
  s.mappings[ptr] = emu::Mapping{size, handle, false};
  h->second.mappings++;
  return CUDA_SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  EMU_ENTER("cuMemUnmap", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  emu::State& s = state();
  size_t g = s.granularity;
  unsigned long long p = ptr;
  if (size == 0 || !aligned(ptr, g) || !aligned(size, g))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemUnmap(0x%llx, %zu): not multiples of the granularity %zu", p, size,
                           g);
  auto run = exact_mappings(ptr, size);
  if (run.empty())
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemUnmap(0x%llx, %zu) must cover whole mappings exactly (no split, "
                           "no hole)",
                           p, size);
  // Work not yet complete that reads the range: a violation, but the unmap happens (the driver
  // does not wait for kernels; on a GPU the kernel would fault).
  const auto* reader = emu::unit_reading(ptr, size);
  if (reader != nullptr) {
    emu::Range r = reader->second.ranges.front();
    for (const emu::Range& each : reader->second.ranges)
      if (each.start < ptr + size && ptr < each.start + each.bytes) r = each;
    call_.violation(CUDA_ERROR_INVALID_VALUE,
                    "unmapping [0x%llx, 0x%llx) that in-flight work on stream %s may still read "
                    "(unit %llu, %s, reads from 0x%llx, %zu bytes)",
                    p, p + size, emu::describe(reader->second.stream).c_str(),
                    static_cast<unsigned long long>(reader->first), reader->second.what.c_str(),
                    static_cast<unsigned long long>(r.start), r.bytes);
  }
  // Back to reserved-but-unmapped: anonymous PROT_NONE over the whole range.
  void* got = mmap(reinterpret_cast<void*>(ptr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED) return CUDA_ERROR_UNKNOWN;
  for (auto& m : run) {
    auto h = s.handles.find(m->second.handle);
    if (h != s.handles.end() && --h->second.mappings == 0 && h->second.released) {
      free_handle_memory(call_, h, reader != nullptr);
    }
    s.mappings.erase(m);
  }
  return CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  EMU_ENTER("cuMemSetAccess", emu::kInit | emu::kContext);
  EMU_UNSAFE_DURING_CAPTURE();
  emu::State& s = state();
  unsigned long long p = ptr;
  if (desc == nullptr || count == 0)
    return call_.violation(CUDA_ERROR_INVALID_VALUE, "cuMemSetAccess: no access descriptors");
  int prot = PROT_NONE;
  for (size_t i = 0; i < count; i++) {
    if (desc[i].location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        !emu::device_valid(desc[i].location.id))
      return call_.violation(CUDA_ERROR_INVALID_DEVICE, "cuMemSetAccess: desc[%zu] is not a device",
                             i);
    if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
      prot = PROT_READ | PROT_WRITE;
    else if (desc[i].flags == CU_MEM_ACCESS_FLAGS_PROT_READ && prot == PROT_NONE)
      prot = PROT_READ;
  }
  if (size == 0 || !aligned(ptr, s.granularity) || !aligned(size, s.granularity))
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemSetAccess(0x%llx, %zu): not multiples of the granularity %zu", p,
                           size, s.granularity);
  auto run = exact_mappings(ptr, size);
  if (run.empty())
    return call_.violation(CUDA_ERROR_INVALID_VALUE,
                           "cuMemSetAccess(0x%llx, %zu) must cover a fully mapped range of whole "
                           "mappings",
                           p, size);
  if (mprotect(reinterpret_cast<void*>(ptr), size, prot) != 0) return CUDA_ERROR_UNKNOWN;
  for (auto& m : run) m->second.accessible = prot != PROT_NONE;
  return CUDA_SUCCESS;
}

}  // extern "C"
