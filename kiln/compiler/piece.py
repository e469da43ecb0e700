"""Per-piece Inductor compilation: one dynamic-shape build plus one build per ``compile.sizes``.

Rules kept here:
- Identical pieces compile once. A piece's key is a hash of its graph with node names replaced
  by positions, plus every input's shape, stride and dtype; the middle transformer layers all
  give the same key, so a 30-layer model compiles three pieces, not thirty-one. Attention calls
  inside a piece (``compile.split_every`` > 1) are numbered from the piece's first layer, which
  the call site sets while the piece runs (``CompiledPiece.layer_base``).
- ``num_tokens`` is the only dynamic dimension. The dynamic build serves every size; a size in
  ``compile.sizes`` gets its own static build, chosen at run time by one dict lookup.
- Every build happens while the graph is captured (at the first call), never while serving.
- The dynamic build makes no size-dependent choice that would guard on ``num_tokens`` (its
  calls skip guards): Inductor's matmul padding (``shape_padding``, CUDA) is off there, since its
  heuristic compares the token count with the other sizes of a matmul whose sizes are not
  aligned (``K > M``: Qwen2-MoE's 60-expert router and 1-wide shared-expert gate guarded
  ``num_tokens < hidden_size``). Static builds keep it.
- A piece on the CPU is built with Inductor's C++ wrapper (``cpp_wrapper``): no Python between
  its kernels.
- Inside ``PieceCompiler.progress()`` each build advances a progress bar (on a terminal only).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch

from kiln.compiler.cancel import check_cancelled
from kiln.ops.attention import set_layer_base
from kiln.progress import logs_above, progress_bar

if TYPE_CHECKING:  # imported when a piece is compiled (seconds at start-up otherwise; kiln.compiler.forward)
    import sympy

    from kiln.passes.manager import PassManager

logger = logging.getLogger(__name__)

# Inductor settings of the dynamic build only (see the module docstring).
DYNAMIC_BUILD_PATCHES = {"shape_padding": False}
# Inductor settings of a piece whose inputs are all on the CPU: a C++ wrapper calls the piece's
# kernels and extern ops, not a Python ``call`` function (a decode step calls ~30 pieces of ~10
# kernels each; SmolLM2 bf16 batch-1 decode, 1 thread: 31.0 -> 28.1 ms a step).
CPU_BUILD_PATCHES = {"cpp_wrapper": True}


def piece_key(gm: torch.fx.GraphModule, example_args: list[Any]) -> str:
    """Hash of the piece's structure and input metadata, independent of node names."""
    index: dict[torch.fx.Node, int] = {}
    lines = []

    def ref(a: Any) -> Any:
        return f"%{index[a]}" if isinstance(a, torch.fx.Node) else a

    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        if node.op == "placeholder":  # its target is its (layer-specific) name: position is enough
            lines.append("placeholder")
            continue
        if node.op == "get_attr":  # a constant attribute: its value is not in the code, so never share
            lines.append(f"get_attr {id(gm)} {node.target}")
            continue
        args = torch.fx.node.map_aggregate(node.args, ref)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, ref)
        target = node.target if isinstance(node.target, str) else torch.fx.node._get_qualified_name(node.target) \
            if callable(node.target) else str(node.target)
        lines.append(f"{node.op} {target} {args} {kwargs}")
    for a in example_args:
        if isinstance(a, torch.Tensor):
            lines.append(f"in {tuple(a.shape)} {a.stride()} {a.dtype} {a.device}")
        else:
            lines.append(f"in {type(a).__name__}")
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


@dataclass
class CompiledPiece:
    """Runs one piece: the static build for this num_tokens if there is one, else the dynamic one.
    Pieces of one key share their builds; each call site has its own ``layer_base`` (the first
    layer of the attention calls inside it, which its graph numbers from 0)."""

    key: str
    dynamic: Callable[..., Any]
    size_arg: Optional[int]  # index of the argument that is num_tokens (a SymInt input)
    by_size: dict[int, Callable[..., Any]] = field(default_factory=dict)
    layer_base: int = 0

    def at_layer(self, base: int) -> "CompiledPiece":
        """This piece's builds (the same objects, static builds added later included) at ``base``."""
        return self if base == self.layer_base else CompiledPiece(self.key, self.dynamic, self.size_arg, self.by_size,
                                                                  base)

    def __call__(self, *args: Any) -> Any:
        if self.layer_base:
            set_layer_base(self.layer_base)
            try:
                return self._run(args)
            finally:
                set_layer_base(0)
        return self._run(args)

    def _run(self, args: tuple) -> Any:
        if self.by_size:
            fn = self.by_size.get(args[self.size_arg])
            if fn is not None:
                return fn(*args)
        return self.dynamic(*args)


def _concrete(value: Any, symbol: sympy.Symbol, size: int) -> int:
    if isinstance(value, torch.SymInt):
        import sympy

        expr = sympy.sympify(value.node.expr).xreplace({symbol: sympy.Integer(size)})
        if expr.free_symbols:
            raise ValueError(f"dimension {value} depends on more than num_tokens")
        return int(expr)
    return int(value)


def _is_symbolic(t: torch.Tensor) -> bool:
    return any(isinstance(d, torch.SymInt) for d in (*t.shape, *t.stride()))


def concrete_args(fake_args: list[Any], real_of: dict[int, torch.Tensor], symbol: sympy.Symbol, size: int) -> list[Any]:
    """Example inputs for a static build at ``size``: real parameters, zero activations."""
    out = []
    for a in fake_args:
        if isinstance(a, torch.SymInt):
            out.append(_concrete(a, symbol, size))
        elif isinstance(a, torch.Tensor) and id(a) in real_of and not _is_symbolic(a):
            out.append(real_of[id(a)])  # a parameter or buffer
        elif isinstance(a, torch.Tensor):  # an activation (or input_ids/positions): any values do
            shape = [_concrete(d, symbol, size) for d in a.shape]
            stride = [_concrete(s, symbol, size) for s in a.stride()]
            out.append(torch.empty_strided(shape, stride, dtype=a.dtype, device=a.device).zero_())
        else:
            out.append(a)
    return out


@dataclass
class _PieceSource:
    """What a static build needs: the piece's graph and its (fake) example inputs."""

    gm: torch.fx.GraphModule
    fake_args: list[Any]
    real_of: dict[int, torch.Tensor]
    symbol: sympy.Symbol


class PieceCompiler:
    """Compiles pieces with Inductor, the kiln passes running as its post-grad pre-pass."""

    def __init__(self, passes: PassManager, extra_patches: dict) -> None:
        self.passes = passes
        self.patches = {"post_grad_custom_pre_pass": passes, **extra_patches}
        self.cache: dict[str, CompiledPiece] = {}
        self._sources: dict[str, _PieceSource] = {}
        self.num_compiles = 0  # Inductor builds (dynamic + static), after dedup
        self.compile_seconds = 0.0
        self._bar = None  # a tqdm bar while ``progress`` is open

    @contextlib.contextmanager
    def progress(self) -> Iterator[None]:
        """Count the Inductor builds made inside the block on a progress bar. How many pieces are
        unique is known only once the split graph has been walked, so the bar gets its total when
        the static builds start."""
        bar = progress_bar(desc="compiling pieces (Inductor)", unit="build",
                           bar_format="{desc}: {n_fmt} built [{elapsed}{postfix}]")
        with bar, logs_above(bar):
            self._bar = bar
            try:
                yield
            finally:
                self._bar = None

    def compile_dynamic(
        self, name: str, gm: torch.fx.GraphModule, fake_args: list[Any],
        real_of: dict[int, torch.Tensor], symbol: sympy.Symbol,
    ) -> CompiledPiece:
        """The dynamic build of a piece (or the one already built for an identical piece)."""
        key = piece_key(gm, fake_args)
        if key not in self.cache:
            size_args = [i for i, a in enumerate(fake_args) if isinstance(a, torch.SymInt)]
            dynamic = self._build(key, "dynamic", gm, fake_args, "from_tracing_context", DYNAMIC_BUILD_PATCHES)
            self.cache[key] = CompiledPiece(key, dynamic, size_args[0] if size_args else None)
            self._sources[key] = _PieceSource(gm, fake_args, real_of, symbol)
        return self.cache[key]

    def returns_one_value(self, key: str) -> bool:
        """Whether the piece's graph returns a single value rather than a tuple of them."""
        return isinstance(self._sources[key].gm.graph.output_node().args[0], torch.fx.Node)

    def compile_sizes(self, sizes: set[int]) -> None:
        """A static build per size for every piece that takes num_tokens as an input."""
        if self._bar is not None:
            pending = sum(len(sizes - set(p.by_size)) for p in self.cache.values() if p.size_arg is not None)
            self._bar.total = self._bar.n + pending
            self._bar.bar_format = None  # the default, with a percentage and an ETA, now that there is a total
            self._bar.refresh()
        for key, piece in self.cache.items():
            src = self._sources[key]
            if piece.size_arg is None:
                logger.info("piece %s has no num_tokens input; only its dynamic build is used", key)
                continue
            for size in sorted(sizes - set(piece.by_size)):
                args = concrete_args(src.fake_args, src.real_of, src.symbol, size)
                piece.by_size[size] = self._build(key, f"size{size}", src.gm, args, "from_example_inputs")

    def _build(self, key: str, variant: str, gm: torch.fx.GraphModule, args: list[Any], dynamic_shapes: str,
               patches: Optional[dict] = None):
        t0 = time.perf_counter()
        self.passes.label = f"piece_{key}_{variant}"
        if self._bar is not None:
            self._bar.set_postfix_str(f"piece {key[:8]} {variant}")
        on_cpu = all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))
        patches = {**self.patches, **(CPU_BUILD_PATCHES if on_cpu else {}), **(patches or {})}
        from torch._inductor import standalone_compile

        check_cancelled()
        artifact = standalone_compile(gm, args, dynamic_shapes=dynamic_shapes, options={"config_patches": patches})
        elapsed = time.perf_counter() - t0
        self.num_compiles += 1
        self.compile_seconds += elapsed
        if self._bar is not None:
            self._bar.update()
        logger.info("compiled piece %s (%s) in %.2f s", key, variant, elapsed)
        return artifact
