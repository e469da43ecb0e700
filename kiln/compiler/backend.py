"""``KilnBackend``: the torch.compile backend of ``compile.mode=kiln``.

Dynamo hands it the captured graph once (``num_tokens`` symbolic). It then:

1. runs the dynamo-stage passes (``PassManager.run_dynamo``),
2. splits the graph at the attention ops (``kiln.compiler.split``; the KernelSet names them),
3. walks the split graph on fake inputs and, at each piece, compiles it with Inductor
   (``kiln.compiler.piece``; the post-grad passes run inside), swapping the submodule for the
   compiled piece; attention submodules stay as they are,
4. checks the capture's guards on ``num_tokens`` (``sizes_excluded_by_guards``): sizes they
   exclude get static builds, any other guard is refused,
5. returns a function running the split graph, which from then on is the whole compiled
   forward (``dry_run`` skips the one execution Dynamo does right after capturing).

It also records what the caller needs to run that graph without Dynamo: the placeholder order and
each placeholder's Dynamo source (``Capture``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Optional

import sympy
import torch
from torch._guards import detect_fake_mode
from torch._dispatch.python import enable_python_dispatcher

from kiln.compiler.debug import DebugDump
from kiln.compiler.piece import PieceCompiler
from kiln.compiler.split import number_layers_from_zero, split_graph
from kiln.ops.registry import GENERIC_ATTENTION_OP
from kiln.passes.manager import PassManager
from kiln.passes.sdpa_to_paged import check_no_sdpa_left

logger = logging.getLogger(__name__)


@dataclass
class Capture:
    """The result of the one capture: the compiled forward and how to call it."""

    split_gm: torch.fx.GraphModule
    sources: list[str]  # Dynamo source of each placeholder, in call order ("L['input_ids']", ...)
    example_inputs: list[Any]  # real tensors for parameters and buffers, SymInt for num_tokens
    num_pieces: int
    num_unique_pieces: int


class _PieceCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake tensors, compiling each piece at its first (only) call."""

    def __init__(self, split_gm, compile_names, compiler: PieceCompiler, real_of, symbol, labels):
        super().__init__(split_gm)
        self.compile_names = compile_names
        self.compiler = compiler
        self.real_of = real_of
        self.symbol = symbol
        self.labels = labels

    def call_module(self, target, args, kwargs):
        base = number_layers_from_zero(self.fetch_attr(target)) if target in self.compile_names else 0
        out = super().call_module(target, args, kwargs)
        if target in self.compile_names:
            piece = self.compiler.compile_dynamic(target, self.fetch_attr(target), list(args), self.real_of, self.symbol)
            self.labels[target] = f"piece {piece.key}" + (f" from layer {base}" if base else "")
            # Instance attribute, not a child module: it shadows the submodule for the graph's
            # `self.submod_i(...)` calls, while named_children() still shows the original code.
            self.module.__dict__[target] = piece.at_layer(base)
        return out


class KilnBackend:
    def __init__(self, passes: PassManager, sizes: tuple[int, ...], dump: Optional[DebugDump] = None,
                 split_op_names: Collection[str] = (GENERIC_ATTENTION_OP,), split_every: int = 1) -> None:
        self.passes = passes
        self.split_op_names = tuple(split_op_names)
        self.split_every = split_every  # compile.split_every: cut at every split_every-th split op call
        self.dump = dump
        patches = dump.inductor_config_patches() if dump else {}
        self.sizes = set(sizes)
        self.compiler = PieceCompiler(passes, patches)
        self.excluded_sizes: set[int] = set()
        self.capture: Optional[Capture] = None
        self.dry_run = False  # True while capturing: Dynamo's first execution is skipped
        self.num_captures = 0
        self.capture_seconds = 0.0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., tuple]:
        t0 = time.perf_counter()
        self.num_captures += 1
        if self.num_captures > 1:
            logger.warning("kiln backend: graph captured again (capture #%d); this is a recompile", self.num_captures)
        sources = [_source_name(n) for n in gm.graph.find_nodes(op="placeholder")]
        self.passes.label = "dynamo_graph"
        self.passes.run_dynamo(gm)
        check_no_sdpa_left(gm.graph)  # an SDPA the attention pass could not rewrite: never run it
        if self.dump:
            self.dump.write("dynamo_graph.py", gm.code)
        split_gm, pieces = split_graph(gm, self.split_op_names, self.split_every)
        compile_names = {p.name for p in pieces if not p.is_split_op}
        labels: dict[str, str] = {}
        self._compile_pieces(split_gm, example_inputs, compile_names, labels)
        if self.dump:
            self.dump.split(split_gm, labels)
        # Sizes the dynamic builds are not valid for get static builds (compile_static_sizes).
        self.excluded_sizes = sizes_excluded_by_guards(_num_tokens_symbol(example_inputs))
        self.capture = Capture(split_gm, sources, list(example_inputs), len(compile_names), len(self.compiler.cache))
        self.capture_seconds += time.perf_counter() - t0
        logger.info("kiln: %d pieces (%d unique), %d Inductor builds, captured in %.1f s",
                    len(compile_names), len(self.compiler.cache), self.compiler.num_compiles, self.capture_seconds)
        num_outputs = len(gm.graph.output_node().args[0])

        def run(*args):
            if self.dry_run:
                return tuple(torch.empty(0) for _ in range(num_outputs))
            return split_gm(*args)

        return run

    def compile_static_sizes(self) -> None:
        """Static builds for ``compile.sizes`` and the sizes the guards exclude.

        Called after the capture returns, outside Dynamo's tracing context: each static build
        gets a fake mode of its own and adds nothing to the capture's shape environment.
        """
        t0 = time.perf_counter()
        self.compiler.compile_sizes(self.sizes | self.excluded_sizes)
        self.capture_seconds += time.perf_counter() - t0

    def _compile_pieces(self, split_gm, example_inputs, compile_names, labels) -> None:
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            raise RuntimeError("kiln backend must be called by Dynamo (no fake mode in the tracing context)")
        fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in example_inputs]
        real_of = {id(f): r for f, r in zip(fake_args, example_inputs) if isinstance(r, torch.Tensor)}
        symbol = _num_tokens_symbol(example_inputs)
        interp = _PieceCompileInterpreter(split_gm, compile_names, self.compiler, real_of, symbol, labels)
        with fake_mode, enable_python_dispatcher():
            interp.run(*fake_args)
        split_gm.recompile()


_SMALL_SIZES = range(1, 9)
_PROBE_SIZES = (*_SMALL_SIZES, 16, 63, 64, 65, 1000, 65536)


def sizes_excluded_by_guards(symbol: sympy.Symbol) -> set[int]:
    """The num_tokens values the capture's guards exclude; refuse any other kind of guard.

    Later calls skip Dynamo's guards, so a guard on num_tokens recorded while capturing would
    go unchecked. Fake-tensor stride rules ask "is this dim 1?" (``Ne(s0, 1)``, ``s0 > 1``):
    guards that exclude only a few small sizes are fine as long as those sizes get static builds
    (the caller adds them). A guard that cuts the size range anywhere else (say ``s0 <= 64``
    from a size-dependent kernel choice) makes the capture unusable without guards: refused.
    """
    shape_env = torch._guards.TracingContext.get().fake_mode.shape_env
    replaced = shape_env.replacements.get(symbol)
    if replaced is not None and not replaced.free_symbols:
        raise RuntimeError(f"kiln: the capture specialized num_tokens to {replaced}; "
                           "the compiled graph would be wrong for other sizes")
    excluded: set[int] = set()
    for guard in shape_env.guards:
        expr = shape_env.simplify(guard.expr)
        if symbol not in expr.free_symbols:
            continue
        if isinstance(expr, sympy.Eq) and all(isinstance(a, sympy.Symbol) for a in expr.args):
            continue  # s0 == s1: input_ids and positions have the same length
        if expr.free_symbols != {symbol}:
            raise RuntimeError(f"kiln: the capture guarded on num_tokens ({guard.expr}{_where(guard)}); "
                               "cannot run it without guards")
        fails = {n for n in _PROBE_SIZES if not bool(expr.xreplace({symbol: sympy.Integer(n)}))}
        if fails - set(_SMALL_SIZES):
            raise RuntimeError(f"kiln: the capture guarded on num_tokens ({guard.expr}{_where(guard)}), which "
                               f"excludes sizes {sorted(fails)}; the compiled graph is not valid for every size")
        excluded |= fails
    if excluded:
        logger.info("kiln: the dynamic builds assume num_tokens not in %s; those sizes get static builds",
                    sorted(excluded))
    return excluded


def _where(guard: Any) -> str:
    """Where a guard was added: the model's line and the torch/Inductor function that asked."""
    sloc = getattr(guard, "sloc", None)
    return f", added at {sloc}" if sloc is not None else ""


def _source_name(node: torch.fx.Node) -> str:
    grapharg = node.meta.get("grapharg")
    if grapharg is None or grapharg.source is None:
        raise RuntimeError(f"graph input {node.name} has no Dynamo source; kiln cannot call the graph without guards")
    name = grapharg.source.name
    return name() if callable(name) else name


def _num_tokens_symbol(example_inputs: list[Any]) -> sympy.Symbol:
    syms = {a.node.expr for a in example_inputs if isinstance(a, torch.SymInt)}
    if len(syms) != 1 or not isinstance(next(iter(syms)), sympy.Symbol):
        raise RuntimeError(f"kiln expects exactly one symbolic size (num_tokens) in the captured graph, got {syms}")
    return next(iter(syms))
