// retry_once: undo steps get one retry. A rollback that half fails would leave a row mapping
// something its record does not say, which is worse than the error being reported.
#pragma once

namespace vattention {

template <typename F>
void retry_once(F&& call) {
  try {
    call();
  } catch (...) {
    call();
  }
}

}  // namespace vattention
