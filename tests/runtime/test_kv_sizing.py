"""The KV cache tensors ``kiln.runtime.kv_sizing`` allocates."""

import torch


def test_cpu_kv_caches_are_separate_zeroed_tensors_of_the_cache_shape():
    """On the CPU the caches come from anonymous mappings (zeroed by the OS as they are touched):
    every layer's tensor has the cache's shape and dtype, reads zeros, and is its own memory."""
    from kiln.runtime.kv_sizing import KVShape, allocate_kv_caches

    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        shape = KVShape(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=dtype)
        caches = allocate_kv_caches(shape, 5, torch.device("cpu"))
        assert [tuple(c.shape) for c in caches] == [(2, 5, 16, 2, 8)] * 3
        assert all(c.dtype == dtype and c.is_contiguous() and not c.float().any() for c in caches)
        values = torch.randn(caches[1].shape).to(dtype)
        caches[1].copy_(values)
        assert torch.equal(caches[1].float(), values.float())
        assert not caches[0].float().any() and not caches[2].float().any()
