"""``KilnPass``: the one interface every graph pass implements.

A pass rewrites an FX graph in place and returns how many rewrites it made. It declares where it
runs (``stage``):

- ``"dynamo"``: on the graph Dynamo captured (torch-level ops), before the graph is split at the
  attention ops. Only passes that must see the split ops themselves run here.
- ``"post_grad"``: on each piece inside Inductor, as its ``post_grad_custom_pre_pass``: aten-level,
  functionalized and decomposed, before Inductor's own pattern rewrites.

``uuid()`` is a hash of the source file that defines the pass plus its options, so Inductor's
cache (which keys on it) misses exactly when a pass's code or settings change.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import operator
import sys
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor

from kiln.ops.registry import op_name

STAGES = ("dynamo", "post_grad")


def node_tensor(node: Any) -> Optional[torch.Tensor]:
    """The (fake) tensor a graph node computes: Dynamo's ``example_value``, else Inductor's ``val``;
    None for a non-node or a node whose value is not a tensor."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def fake_node(graph: torch.fx.Graph, kind: str, target: Any, args: tuple,
              kwargs: Optional[dict] = None) -> torch.fx.Node:
    """A new ``call_function`` / ``call_method`` node at the graph's insertion point, with its fake
    value computed as Dynamo does (the Python dispatcher gives composite ops their symbolic-shape
    decompositions), under the key its arguments use: ``meta["example_value"]`` in a Dynamo graph,
    ``meta["val"]`` in a post_grad one.

    Dynamo-stage passes (and ``HeadsViewPass``) create their nodes through this: later passes read
    shapes from the value, and the AOTAutograd cache, which the artifact cache stores, refuses a
    graph that calls a method on a node without one (the entry is then not stored and every restart compiles again). With no
    fake tensor among the arguments, fake tensors of several modes, or an argument node without a
    value (a graph built by hand), the node gets no value, except a ``getitem`` of a sequence.
    """
    kwargs = kwargs or {}
    node = graph.create_node(kind, target, tuple(args), kwargs)
    vals = [a.meta.get("example_value", a.meta.get("val")) if isinstance(a, torch.fx.Node) else a for a in args]
    modes = {id(v.fake_mode): v.fake_mode for v in vals if isinstance(v, FakeTensor)}
    fake = next(iter(modes.values())) if len(modes) == 1 else None
    is_getitem = kind == "call_function" and target is operator.getitem and isinstance(vals[0], (tuple, list))
    unknown = any(isinstance(a, torch.fx.Node) and v is None for a, v in zip(args, vals))
    if unknown or (fake is None and not is_getitem):
        return node
    # Dynamo's nodes keep their value under "example_value", Inductor's (post_grad) under "val".
    key = "example_value" if any(isinstance(a, torch.fx.Node) and "example_value" in a.meta for a in args) else "val"
    with fake if fake is not None else contextlib.nullcontext(), enable_python_dispatcher():
        node.meta[key] = (getattr(vals[0], target)(*vals[1:], **kwargs) if kind == "call_method"
                          else target(*vals, **kwargs))
    return node


def keep_source_meta(new: torch.fx.Node, old: torch.fx.Node) -> None:
    """Give ``new`` the model source ``old`` came from (module path and stack trace), for dumps and errors."""
    new.meta.update({k: v for k, v in old.meta.items() if k in ("nn_module_stack", "stack_trace")})


def source_hash(*objects: Any) -> str:
    """sha256 over the source files that define ``objects`` (classes, functions or modules)."""
    h = hashlib.sha256()
    for obj in objects:
        module = obj if inspect.ismodule(obj) else sys.modules[obj.__module__]
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()


class KilnPass(ABC):
    stage: ClassVar[str] = "post_grad"

    @property
    def name(self) -> str:
        return type(self).__name__

    def options(self) -> dict[str, Any]:
        """Settings that change what the pass does; part of ``uuid()``."""
        return {}

    def uuid(self) -> str:
        h = hashlib.sha256(source_hash(type(self), KilnPass).encode())
        h.update(json.dumps(self.options(), sort_keys=True, default=str).encode())
        return h.hexdigest()

    @abstractmethod
    def __call__(self, graph: torch.fx.Graph) -> int:
        """Rewrite ``graph`` in place; return the number of rewrites."""


def retarget(graph: torch.fx.Graph, generic_name: str, op: Any) -> int:
    """Point every call of the generic op ``generic_name`` ('ns::name') at ``op``, a kernel op of
    the same schema (a packet or overload); returns how many calls moved. Overload calls keep
    their overload name."""
    if op_name(op) == generic_name:
        return 0
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and op_name(node.target) == generic_name:
            overload = node.target._overloadname if isinstance(node.target, torch._ops.OpOverload) else None
            node.target = getattr(op, overload) if overload and isinstance(op, torch._ops.OpOverloadPacket) else op
            count += 1
    return count
