// kiln_cpu::attend_paged: the CPU attention op compiled graphs hold, with no Python per call.
//
// The op has the schema of the generic kiln::attend_paged (q, k, v, layer_idx, scale, ...): the KV
// cache and the step's metadata are not arguments but come from the step. In Python they travel
// in the forward context (kiln/forward_context.py), which a Python op would read on every call:
// two Python layers per layer and step, about 30 us each on a 2-core Xeon. Here the step's
// context is handed to C++ once, at the start of the forward (set_attention_context, from the
// scope kiln/ops/cpu_attention.py enters around each compiled forward), and every call reads it:
//
//   forward scope enter   set_attention_context(kv_caches, slot_mapping, block_tables, seq_lens,
//                                               query_start_loc, kv_scales)     one call a step
//   compiled pieces       attend_paged(q, k, v, layer_idx, scale, ...)          C++ -> kernel
//   forward scope exit    clear_attention_context()
//
// A compiled piece that numbers its layers' calls from 0 sets its first layer around its run
// (set_layer_base); every call reads layer layer_base + layer_idx.
//
// Rules kept here:
// - One context per thread (a forward runs on one thread), set only inside the scope; setting it
//   twice without a clear is refused, as nested forward contexts are.
// - Without a context (a forward the scope left to Python: an FP8 cache's calibration step, a
//   plain forward_context in tests) or for inputs the kernel does not take (float16, mixed), the op
//   calls kiln_cpu::attend_paged_py, the Python op over the forward context: same results.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "error.h"
#include "paged_attention.h"

#include <optional>
#include <vector>

namespace kiln {
namespace {

struct AttentionContext {
  std::vector<at::Tensor> kv_caches;  // one per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
  std::vector<at::Tensor> kv_scales;  // empty, or one float32 [2] per layer (an FP8 cache's)
  at::Tensor slot_mapping;            // [num_tokens] int64
  at::Tensor block_tables;            // [num_reqs, width] int32
  at::Tensor seq_lens;                // [num_reqs] int32
  at::Tensor query_start_loc;         // [num_reqs + 1] int32
};

thread_local std::optional<AttentionContext> current;
// Added to every call's layer_idx: set by a compiled piece that numbers its layers from 0 while it
// runs (kiln/compiler/piece.py), 0 otherwise. The Python fallback reads the forward context's own.
thread_local int64_t layer_base = 0;

void set_layer_base(int64_t base) { layer_base = base; }

void set_attention_context(at::TensorList kv_caches, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, at::TensorList kv_scales) {
  TORCH_CHECK(!current.has_value(), "kiln_cpu: an attention context is already set (nested forwards?)");
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == kv_caches.size(), "kv_scales: none or one per layer");
  current = AttentionContext{kv_caches.vec(), kv_scales.vec(), slot_mapping.to(at::kLong).contiguous(),
                             block_tables.to(at::kInt).contiguous(), seq_lens.to(at::kInt).contiguous(),
                             query_start_loc.to(at::kInt).contiguous()};
}

void clear_attention_context() { current.reset(); }

bool has_attention_context() { return current.has_value(); }

at::Tensor attend_paged_py(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                           double scale, int64_t sliding_window, double logit_softcap) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kiln_cpu::attend_paged_py", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               double, int64_t, double)>();
  return op.call(q, k, v, layer_idx, scale, sliding_window, logit_softcap);
}

at::Tensor attend_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer_idx,
                        double scale, int64_t sliding_window, double logit_softcap) {
  const auto dtype = q.scalar_type();
  if (!current.has_value() || (dtype != at::kFloat && dtype != at::kBFloat16) || k.scalar_type() != dtype ||
      v.scalar_type() != dtype) {
    return attend_paged_py(q, k, v, layer_idx, scale, sliding_window, logit_softcap);
  }
  const AttentionContext& ctx = *current;
  const int64_t layer = layer_base + layer_idx;
  TORCH_CHECK(layer >= 0 && layer < int64_t(ctx.kv_caches.size()),
              kiln::message("attend_paged: layer ", layer, " of ", ctx.kv_caches.size()));
  at::Tensor cache = ctx.kv_caches[layer];
  if (cache.scalar_type() != dtype && cache.scalar_type() != at::kFloat8_e4m3fn) {
    return attend_paged_py(q, k, v, layer_idx, scale, sliding_window, logit_softcap);
  }
  std::optional<at::Tensor> kv_scale;
  if (!ctx.kv_scales.empty()) kv_scale = ctx.kv_scales[layer];
  at::Tensor out = at::empty(q.sizes(), q.options().memory_format(at::MemoryFormat::Contiguous));
  attend_paged_cpu_into(q, k, v, cache, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.query_start_loc, scale,
                        sliding_window, logit_softcap, kv_scale, out);
  return out;
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpu, m) {
  m.def("attend_paged(Tensor q, Tensor k, Tensor v, int layer_idx, float scale, int sliding_window=0, "
        "float logit_softcap=0.) -> Tensor");
  // Catch-all kernels: they touch no tensor data, and clear/has have no tensor to dispatch on.
  m.def("set_attention_context(Tensor[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, Tensor[] kv_scales) -> ()",
        TORCH_FN(kiln::set_attention_context));
  m.def("clear_attention_context() -> ()", TORCH_FN(kiln::clear_attention_context));
  m.def("has_attention_context() -> bool", TORCH_FN(kiln::has_attention_context));
  m.def("set_layer_base(int base) -> ()", TORCH_FN(kiln::set_layer_base));
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("attend_paged", &kiln::attend_paged); }
