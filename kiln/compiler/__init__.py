"""The compiler: capture, kiln's torch.compile backend, graph splitting, per-piece Inductor builds.

Entry point: ``build_forward(model, compile_config) -> (input_ids, positions) -> hidden``.
"""

from kiln.compiler.capture import KilnForward
from kiln.compiler.forward import build_forward

__all__ = ["build_forward", "KilnForward"]
