"""``build_forward``: the model's forward callable for each ``compile.mode``.

- ``eager``: the model itself.
- ``stock``: ``torch.compile(model, dynamic=True)``, the baseline a user tries first: Dynamo
  guards run on every call and sizes 0/1 are specialized (a batch of one token recompiles once).
- ``kiln``: ``KilnForward``: capture once, kiln passes, split at attention, Inductor per piece,
  no guards after the capture. With an ``ArtifactCache`` it loads all of that from disk when a
  previous start stored it (``kiln.compiler.artifact_cache``).

``compile.cudagraph`` is GPU-only; on CPU it is ignored with a warning.

kiln's passes and backend (and with them ``torch._inductor`` and ``torch._dynamo``, seconds of
imports) are imported by ``build_kiln_forward`` alone, so a process that serves eagerly first
(a background build (``compile.startup``)) leaves them to the build's thread.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from kiln.compiler.artifact_cache import ArtifactCache, forward_key, key_factors
from kiln.compiler.capture import CAPTURE_NUM_TOKENS, KilnForward
from kiln.compiler.debug import DebugDump
from kiln.config import CompileConfig, default_split_every
from kiln.ops.registry import KernelSet, select_kernels

if TYPE_CHECKING:
    from kiln.passes.manager import PassConfig

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _model_device_type(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return param.device.type if param is not None else "cpu"


def build_forward(model: nn.Module, config: CompileConfig, pass_config: Optional[PassConfig] = None,
                  artifact_cache: Optional[ArtifactCache] = None) -> Forward:
    """``(input_ids [T], positions [T]) -> hidden [T, H]``, compiled as ``config.mode`` says.

    ``pass_config`` (kiln mode) carries the ``KernelSet`` the passes write into the graph; it
    defaults to the kernels selected for the model's device. ``artifact_cache`` (kiln mode only)
    loads and stores the compiled forward across processes. In eager and stock modes the generic
    attention op runs the kernel the forward context names (``CompiledModel`` sets it).
    """
    device_type = _model_device_type(model)
    if config.cudagraph not in ("none", "auto") and device_type != "cuda":
        logger.warning("compile.cudagraph=%s needs CUDA; running without CUDA graphs on %s",
                       config.cudagraph, device_type)
    if config.mode == "eager":
        return model
    if config.mode == "stock":
        return _stock_forward(model)
    if config.mode == "kiln":
        if pass_config is None:
            from kiln.passes.manager import PassConfig

            pass_config = PassConfig(kernels=select_kernels(device_type))
        return build_kiln_forward(model, config, pass_config, artifact_cache)
    if config.mode == "auto":
        raise ValueError("compile.mode=auto is decided per device: resolve the config first "
                         "(kiln.config.resolve_for_device)")
    raise ValueError(f"compile.mode={config.mode!r} is not allowed; choose one of ['eager', 'stock', 'kiln']")


def _stock_forward(model: nn.Module) -> Forward:
    compiled = torch.compile(model, dynamic=True)

    def stock(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # kiln's step buffers hand positions over as a view at a fixed offset (max_num_tokens, after
        # the ids). With dynamic shapes Dynamo's duck sizing equates that offset with the token count
        # when they are equal (a first step that is a whole 2048-token chunk) and guards on it, so
        # the next step compiled the whole model again (SmolLM2 on a 2-vCPU CPU: 85 s). A copy at
        # offset 0 keeps the buffer layout out of the guards.
        return compiled(input_ids, positions if positions.storage_offset() == 0 else positions.clone())

    return stock


def forward_profile_key(model: nn.Module, config: CompileConfig, kernels: KernelSet,
                        artifact_cache: Optional[ArtifactCache]) -> Optional[str]:
    """The key ``build_forward`` would file kiln's forward under, as far as what is kept beside it
    goes (``artifact_cache.forward_key``), known without building it; None when nothing is cached
    (another mode, no cache, or a debug dump, which always captures)."""
    if config.mode != "kiln" or artifact_cache is None or config.debug_dump_dir:
        return None
    return forward_key(model, artifact_cache.model_name, _with_split_every(config, model), kernels, CAPTURE_NUM_TOKENS)


def _with_split_every(config: CompileConfig, model: nn.Module) -> CompileConfig:
    """``config`` with ``split_every`` decided for the model's device where it was not resolved
    (``kiln.config.resolve_for_device`` does it for an engine's config)."""
    if config.split_every is not None:
        return config
    return dataclasses.replace(config, split_every=default_split_every(_model_device_type(model)))


def build_kiln_forward(model: nn.Module, config: CompileConfig, pass_config: PassConfig,
                       artifact_cache: Optional[ArtifactCache] = None) -> KilnForward:
    from kiln.compiler.backend import KilnBackend
    from kiln.passes.manager import PassManager, build_passes

    config = _with_split_every(config, model)
    dump = DebugDump(config.debug_dump_dir) if config.debug_dump_dir else None
    # A generic-path model's per-layer windows and soft-caps, for the attention pass.
    attention_layers = tuple(getattr(model, "attention_layers", ()))
    if any(w or c for w, c in attention_layers):
        pass_config = dataclasses.replace(pass_config, attention_layers=attention_layers)
    passes = PassManager(build_passes(pass_config), dump=dump.pass_graph if dump else None)
    backend = KilnBackend(passes, config.sizes, dump, split_op_names=pass_config.kernels.split_op_names(),
                          split_every=config.split_every)
    entry = None
    if artifact_cache is not None and dump is not None:
        logger.info("compile.debug_dump_dir is set: not using the artifact cache (a dump needs a capture)")
    elif artifact_cache is not None:
        factors = key_factors(model, artifact_cache.model_name, config, passes, CAPTURE_NUM_TOKENS)
        entry = artifact_cache.entry(factors)
    return KilnForward(model, backend, depyf_context=dump.depyf if dump else None, cache=entry)


def build_now(forward: Forward, device: torch.device) -> None:
    """Capture or load a kiln forward now, at start-up, rather than at its first call."""
    if isinstance(forward, KilnForward):
        with torch.inference_mode():
            forward.build(device)


def compile_seconds(forward: Forward) -> dict[str, float]:
    """Start-up compile time by phase (0 for a phase that did not run, or for eager and stock)."""
    if not isinstance(forward, KilnForward):
        return {"dynamo_s": 0.0, "inductor_s": 0.0, "cache_load_s": 0.0}
    return {"dynamo_s": forward.dynamo_seconds, "inductor_s": forward.inductor_seconds,
            "cache_load_s": forward.cache_load_seconds}
