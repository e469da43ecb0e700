"""The compiler: capture, kiln's torch.compile backend, graph splitting, per-piece Inductor builds,
CUDA graphs (full and piecewise) and their per-batch dispatch.

Entry point: ``build_forward(model, compile_config) -> (input_ids, positions) -> hidden``.
"""

from kiln.compiler.artifact_cache import ArtifactCache
from kiln.compiler.capture import KilnForward
from kiln.compiler.forward import build_forward, build_now, compile_seconds

__all__ = ["ArtifactCache", "build_forward", "build_now", "compile_seconds", "KilnForward"]
