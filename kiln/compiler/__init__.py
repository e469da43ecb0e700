"""The compiler: capture, kiln's torch.compile backend, graph splitting, per-piece Inductor builds,
CUDA graphs (full and piecewise) and their per-batch dispatch.

Its boundary is one object, ``CompiledModel`` (``kiln.compiler.compiled_model``): built from the
loaded model, the ``CompileConfig`` and a ``KernelSet``; ``run(ModelInputs) -> ModelOutputs``.
``build_forward`` is the lower-level entry: ``(input_ids, positions) -> hidden`` for one mode.
"""

from kiln.compiler.artifact_cache import ArtifactCache
from kiln.compiler.capture import KilnForward
from kiln.compiler.compiled_model import CompiledModel, ModelOutputs
from kiln.compiler.forward import build_forward, build_now, compile_seconds, forward_profile_key
from kiln.compiler.graph_memory import GraphMemoryEstimate
from kiln.compiler.inputs import InputBuffers, InputLimits, ModelInputs, VerifyShape

__all__ = ["ArtifactCache", "build_forward", "build_now", "compile_seconds", "CompiledModel", "forward_profile_key", "GraphMemoryEstimate", "InputBuffers",
           "InputLimits", "KilnForward", "ModelInputs", "ModelOutputs", "VerifyShape"]
