"""``define_op``: kiln's ops are dispatcher ops with a fake impl, the schema custom_op would infer."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.ops.library import define_op


def _scale_rows(x: torch.Tensor, scale: float, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return x[:rows] * scale, x.sum(-1)


def _scale_rows_fake(x, scale, rows=1):
    return x.new_empty((rows, x.shape[1])), x.new_empty(x.shape[:1])


_OP = define_op("kiln_test_library::scale_rows", _scale_rows, _scale_rows_fake)


def test_schema_is_the_one_custom_op_infers():
    want = torch.library.infer_schema(_scale_rows, mutates_args=())
    assert str(_OP.default._schema) == "kiln_test_library::scale_rows" + want
    assert _OP is torch.ops.kiln_test_library.scale_rows


def test_calls_run_the_kernel_and_fake_tensors_the_fake():
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    rows, sums = _OP(x, 2.0, rows=2)
    torch.testing.assert_close(rows, x[:2] * 2.0)
    torch.testing.assert_close(sums, x.sum(-1))
    with FakeTensorMode():
        fake_rows, fake_sums = _OP(torch.empty(7, 3), 0.5, 4)
    assert fake_rows.shape == (4, 3) and fake_sums.shape == (7,)
    meta_rows, _ = _OP(torch.empty(6, 3, device="meta"), 1.0, 3)
    assert meta_rows.shape == (3, 3) and meta_rows.device.type == "meta"


def test_opcheck_schema_fake_and_aot_dispatch():
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    torch.library.opcheck(_OP, (x, 3.0, 2), test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_kiln_ops_are_not_custom_op_wrapped():
    import kiln.ops.attention  # noqa: F401
    import kiln.ops.layernorm  # noqa: F401
    from torch._library.custom_ops import _maybe_get_opdef

    for op in (torch.ops.kiln.attend_paged, torch.ops.kiln.add_rms_norm):
        assert _maybe_get_opdef(op.default) is None  # no custom_op wrapper around the kernel
