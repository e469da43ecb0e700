"""Custom ops (``torch.ops.kiln.*``): schema, fake impl, pure-torch reference, faster kernels."""

from kiln.ops import attention  # noqa: F401  (registers torch.ops.kiln.attend_paged)
