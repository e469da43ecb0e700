"""C++ paged attention on CPU: ``torch.ops.kiln_cpu.attend_paged`` and ``cpu_attend_paged``.

Reference: ``kiln.ops.attention.attend_paged_reference``; ``cpu_attend_paged`` has its exact
signature and semantics (store the new K/V, then attend causally over each request's context).
The kernel is ``csrc/paged_attention.cpp``, built by ``setup.py`` into the module ``kiln._C``,
which registers ``torch.ops.kiln_cpu.attend_paged_cpu`` (plus an ``.out`` overload) and
``kiln_cpu::attend_paged(q, k, v, layer_idx, scale, sliding_window=0, logit_softcap=0.0)``, the
schema of ``kiln::attend_paged``: the op ``AttentionBackendPass`` swaps in on CPU. That one is C++
end to end (``csrc/attention_context.cpp``): it reads the cache and metadata from an attention
context the forward's scope (``attention_context``, entered by the compiled model around every
forward) hands to C++ once a step, so a compiled graph calls the kernel with no Python between.
Without that context it calls ``kiln_cpu::attend_paged_py``, the same attention through the Python
forward context. This module:

- loads ``kiln._C`` on first use; without it (installed with no compiler, or a stale build) every
  entry point falls back to the pure-torch reference, and says so once at info level;
- gives the C++ ops their fake impls, so they can appear in a traced graph;
- defines ``kiln_cpu::attend_paged_py``, the Python path over the forward context;
- ``kiln.ops.registry`` selects ``kiln_cpu::attend_paged`` on CPU when ``load_extension()`` succeeds;
- the correctness check (``check_against_reference``) used by ``tests/ops/test_cpu_attention.py``;
  timing is ``python -m benchmarks.kernels cpu-attention``.

q, k and v may be row-strided views of one fused qkv projection: the kernel reads them in place.
The cache is q's dtype or float8_e4m3fn (``cache.dtype=fp8``, with the per-tensor ``kv_scale``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator, Optional

import torch

from kiln.forward_context import AttentionMetadata, ForwardContext
from kiln.ops.attention import attend_paged_reference, define_attention_op, fp8_kv_scale, layer_base_setters
from kiln.ops.paged_batch import PagedBatch, PagedBatchSpec, random_paged_batch  # noqa: F401  (checks and tests)

logger = logging.getLogger(__name__)

KERNEL_DTYPES = (torch.float32, torch.bfloat16)
_extension_loaded: bool | None = None  # None: not tried yet


def load_extension() -> bool:
    """Import ``kiln._C`` (registers the C++ op) once; False if it is not built or does not load."""
    global _extension_loaded
    if _extension_loaded is None:
        try:
            import kiln._C  # noqa: F401

            torch.library.register_fake("kiln_cpu::attend_paged_cpu")(_attend_paged_cpu_fake)
            if has_context_op():
                torch.library.register_fake("kiln_cpu::attend_paged")(_attend_paged_fake)
                layer_base_setters.append(torch.ops.kiln_cpu.set_layer_base.default)
            _extension_loaded = True
        except (ImportError, OSError) as e:
            logger.info("C++ CPU attention unavailable (%s); using the pure-torch reference. "
                        "Build it with `pip install --no-build-isolation -e .`", e)
            _extension_loaded = False
    return _extension_loaded


def extension_ops() -> list[str]:
    """The schemas of the ``kiln_cpu`` ops registered now (``kiln._C``'s and their Python
    companions), sorted; [] without the extension. A compiled graph calls these ops by name, so the
    artifact key includes them: a build without one (an older ``_C``, ``KILN_SKIP_EXTENSION=1``)
    must not load a graph that calls it."""
    if not load_extension():
        return []
    return sorted(str(s) for s in torch._C._jit_get_all_schemas() if s.name.startswith("kiln_cpu::"))


def has_context_op() -> bool:
    """Whether the loaded ``kiln._C`` has the C++ ``kiln_cpu::attend_paged`` and its layer base (a
    build older than ``csrc/attention_context.cpp`` has only ``attend_paged_cpu``; an older one
    of that file has no ``set_layer_base``, and its op would read the wrong layer in a piece that
    numbers its layers from 0)."""
    return hasattr(torch.ops.kiln_cpu, "attend_paged") and hasattr(torch.ops.kiln_cpu, "set_layer_base")


def _attend_paged_cpu_fake(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                           sliding_window=0, logit_softcap=0.0, kv_scale=None):
    return q.new_empty(q.shape)  # the kernel's output is contiguous even when q is a strided view


def _attend_paged_fake(q, k, v, layer_idx, scale, sliding_window=0, logit_softcap=0.0):
    return q.new_empty(q.shape)


def set_attention_lanes(lanes: int) -> int:
    """Run the C++ kernel at ``lanes`` floats a vector from now on (4, 8 or 16, up to the widest this
    CPU has: 16 with AVX-512, 8 with AVX2) or, with 0, at the widest; returns the width in use.
    For tests, which check every width against the reference, and for benchmarks."""
    if not load_extension():
        raise RuntimeError("set_attention_lanes needs kiln._C: run `pip install --no-build-isolation -e .`")
    in_use = torch.ops.kiln_cpu.set_attention_lanes(lanes)  # a width the CPU cannot run is left unapplied
    if lanes != 0 and in_use != lanes:
        raise ValueError(f"set_attention_lanes: 0 (the widest) or 4, 8 or 16 floats up to this CPU's widest, "
                         f"{torch.ops.kiln_cpu.max_attention_lanes()}; got {lanes}")
    return in_use


def cpu_attend_paged(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
    *,
    kv_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Drop-in for ``attend_paged_reference``: store the new K/V, attend; returns [num_tokens, H, D].
    What the kernel lacks (float16, mixed dtypes, tensors off the CPU) goes to the reference."""
    if not (load_extension() and q.device.type == "cpu" and q.dtype in KERNEL_DTYPES
            and q.dtype == k.dtype == v.dtype and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn)):
        return attend_paged_reference(q, k, v, kv_cache, meta, scale, sliding_window, logit_softcap,
                                      kv_scale=kv_scale)
    return torch.ops.kiln_cpu.attend_paged_cpu(
        q, k, v, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
        sliding_window, logit_softcap, fp8_kv_scale(kv_cache, kv_scale),
    )


# ``kiln::attend_paged`` on this kernel, cache and metadata from the Python forward context: what
# the C++ ``kiln_cpu::attend_paged`` calls when no attention context is set.
attend_paged_py = define_attention_op("kiln_cpu::attend_paged_py", cpu_attend_paged)


@contextlib.contextmanager
def attention_context(ctx: ForwardContext) -> Iterator[None]:
    """Hand ``ctx``'s caches and metadata to C++ for the duration of one forward, so
    ``kiln_cpu::attend_paged`` runs the kernel without Python. Left unset (the op then takes the
    Python path) without the extension, without metadata or caches, and on an FP8 cache's
    calibration step (its scales are set in Python from the step's keys and values)."""
    meta = ctx.attn
    if not (load_extension() and has_context_op() and meta is not None and ctx.kv_caches and not ctx.calibrate_kv_scales
            and ctx.kv_caches[0].device.type == "cpu"):
        yield
        return
    torch.ops.kiln_cpu.set_attention_context(ctx.kv_caches, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                             meta.query_start_loc, ctx.kv_scales or [])
    try:
        yield
    finally:
        torch.ops.kiln_cpu.clear_attention_context()


# ---------------------------------------------------------------------------------------------
# Correctness check against the reference (tests and `python -m benchmarks.kernels cpu-attention --check`)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]


def check_against_reference(batch: PagedBatch, sliding_window: int = 0, logit_softcap: float = 0.0,
                            *, kv_scale: Optional[torch.Tensor] = None) -> float:
    """Store + attend with the C++ kernel and the reference on copies of the same cache.
    The cache must match bit for bit; the output, poisoned with NaN first, within ``tolerance``.
    Returns the largest absolute output error."""
    scale = batch.q.shape[-1] ** -0.5
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    ref = attend_paged_reference(batch.q, batch.k, batch.v, ref_cache, batch.meta, scale, sliding_window,
                                 logit_softcap, kv_scale=kv_scale)
    out = torch.full(batch.q.shape, float("nan"), dtype=batch.q.dtype)
    m = batch.meta
    torch.ops.kiln_cpu.attend_paged_cpu.out(
        batch.q, batch.k, batch.v, cache, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc, scale,
        sliding_window, logit_softcap, fp8_kv_scale(cache, kv_scale), out=out,
    )
    if not torch.equal(cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else cache,
                       ref_cache.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else ref_cache):
        raise AssertionError("kv cache after the store differs from the reference's")
    tol = tolerance(batch.q.dtype)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    return (out.float() - ref.float()).abs().max().item()
