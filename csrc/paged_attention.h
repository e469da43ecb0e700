// The CPU paged attention kernel's entry point, shared by csrc/paged_attention.cpp (the
// attend_paged_cpu ops) and csrc/attention_context.cpp (kiln_cpu::attend_paged, which takes the
// cache and metadata from the step's attention context instead of its arguments).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kiln {

// Store the new K/V at slot_mapping, then attend; writes every row of `out` ([num_tokens,
// num_heads, head_dim], contiguous, q's dtype). Semantics and layouts: csrc/paged_attention.cpp.
void attend_paged_cpu_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kv_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t sliding_window,
                           double logit_softcap, const std::optional<at::Tensor>& kv_scale, at::Tensor& out);

}  // namespace kiln
