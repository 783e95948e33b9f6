// Registers the CPU attention kernel (csrc/attention) on the extension module.
#pragma once

#include <pybind11/pybind11.h>

// Adds vattention._C.flash_attn_with_kvcache, prepare_attention, attention_kernel_isa,
// set_attention_kernel_isa, attention_kernel_tuning, set_attention_kernel_tuning.
void register_attention(pybind11::module_& m);
