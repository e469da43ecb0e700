"""How kiln defines its ops: ``define_op`` registers a schema, a Python kernel and a fake impl.

``torch.library.custom_op`` would do the same in one call, but it wraps every call of the op in
Python layers of its own: a ``backend_impl`` that checks outputs do not alias inputs, a
``torch._disable_dynamo`` frame around the kernel, and with grad mode on an autograd kernel that
redispatches. kiln's ops are called outside graphs on every step (attention runs eagerly between
piece graphs, quantized GEMMs in eager mode) and by every warm-up and capture of a CUDA graph, so
``define_op`` registers the kernel with the dispatcher directly (``torch.library.Library`` define +
impl, and ``register_fake``): a call is the dispatcher and the kernel, nothing more
(``python -m benchmarks.decode op-dispatch`` measures both).

Rules the kernels keep in exchange: outputs never alias inputs (custom_op checked it on every call);
ops have no autograd (kiln serves, never trains: a backward through them is not defined, as with
custom_op); the kernel is plain Python that Dynamo never traces (compiled graphs call it through
the dispatcher from code Dynamo does not run).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

# One library fragment per namespace, alive for the process: dropping it would unregister the ops.
_LIBRARIES: dict[str, torch.library.Library] = {}


def define_op(qualname: str, kernel: Callable, fake: Callable, mutates_args: tuple[str, ...] = (),
              schema: Optional[str] = None):
    """Define ``qualname`` ("namespace::name") with the schema inferred from ``kernel``'s type
    annotations (or ``schema``, "(Tensor x, ...) -> Tensor", for a kernel taking ``*args``), running
    ``kernel`` on every device, with ``fake`` as its meta implementation.
    Returns the op (``torch.ops.<namespace>.<name>``), callable like ``kernel``."""
    namespace, name = qualname.split("::")
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    lib.define(name + (schema or torch.library.infer_schema(kernel, mutates_args=mutates_args)))
    lib.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(qualname, fake, lib=lib)
    return getattr(getattr(torch.ops, namespace), name)
