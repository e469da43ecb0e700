"""Turn a ``ModelConfig`` into a ready model, its tokenizer and its limits (``load_model``).

``model_config.model`` is resolved in this order:
1. ``random:<preset>``: real shapes from ``arch.PRESETS``, random weights seeded by
   ``model_config.seed``, the tokenizer borrowed from the registered donor model (or
   ``$KILN_TOKENIZER_DIR`` where the donor's package is not installed).
2. a registered name (``registry.REGISTERED_MODELS``): its GGUF is converted once into the cache dir.
3. a local Hugging Face directory: config.json, *.safetensors (sharded or not) and tokenizer files.
4. a local ``.gguf`` file of a Llama-family model: converted once into the cache dir, as in 2.

``model_config.impl`` then picks the model code (``use_generic``): kiln's own (``kiln.models.llama``)
or, for ``transformers`` and for families kiln lacks under ``auto``, the generic path
(``kiln.models.hf_generic``: transformers' own modeling code, the same weights and random seeds).

Rules kept here: the model is built on the meta device and materialized directly on the target
device in the target dtype, so a big random preset never exists as a float32 CPU copy; random
weights are drawn one full tensor at a time on the target device, each from a generator seeded by
(seed, tensor name), and sharded on load like a checkpoint, so a rank never holds the whole model
and every tensor-parallel size holds the same one; every failure to resolve a name is a
ValueError that says what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch

from kiln.config import ModelConfig
from kiln.errors import first_line
from kiln.models.arch import FAMILIES, PRESETS, ArchConfig
from kiln.models.gguf import convert_gguf, convert_gguf_tokenizer
from kiln.models.hf_generic import HFGenericForCausalLM, build_generic, hf_config_from_dict, import_transformers
from kiln.models.hf_multimodal import build_vision_generic, is_vision_config
from kiln.models.llama import LlamaForCausalLM
from kiln.models.parallel import SINGLE, TensorParallel
from kiln.models.pipeline import WHOLE, PipelineStage
from kiln.models.int4_checkpoint import dequantize_int4_checkpoint
from kiln.models.quantize import (apply_quantization, checkpoint_int4_format, checkpoint_quantization,
                                  collect_kv_scales, dequantize_fp8_checkpoint, quantization_choice,
                                  resolve_quantization)
from kiln.models.registry import REGISTERED_MODELS, TOKENIZER_DIR_ENV, TOKENIZER_DONOR
from kiln.models.weight_reader import ReadAhead, iter_file_into, iter_files_to_device, open_safetensors
from kiln.ops.registry import KernelSet, select_kernels
from kiln.progress import progress_bar

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"
RANDOM_INIT_STD = 0.02
# How long a failed start-up waits for its weight read to stop (it stops at the next tensor).
FILL_CANCEL_WAIT_S = 30.0


@dataclass
class LoadedModel:
    model: LlamaForCausalLM | HFGenericForCausalLM  # HFGenericForCausalLM: model.impl=transformers
    arch: ArchConfig  # a GenericArch (the fields the runtime reads) on the generic path
    tokenizer: Any  # a transformers tokenizer; None while ``tokenizing`` still builds it
    name: str
    hf_dir: Optional[str]  # None for random weights
    max_model_len: int
    filling: Optional["WeightFill"] = None  # weights still being read (load_model(background=True))
    # The checkpoint's FP8 KV cache scales, {layer: [k_scale, v_scale]}; complete once the weights are.
    kv_scales: dict[int, list[float]] = dataclasses.field(default_factory=dict)
    tokenizing: Optional["Background"] = None  # the tokenizer still being built (load_model(background=True))

    def wait_for_tokenizer(self) -> Any:
        """The tokenizer, once built (re-raising what went wrong while building it)."""
        if self.tokenizing is not None:
            self.tokenizer = self.tokenizing.wait()
            self.tokenizing = None
        return self.tokenizer

    def wait_for_weights(self) -> float:
        """Block until every weight is in place (re-raising what went wrong while reading them);
        the seconds the read took, 0 when nothing was in flight."""
        if self.filling is None:
            return 0.0
        seconds = self.filling.wait()
        self.filling = None
        return seconds

    def cancel_fill(self, timeout: float = FILL_CANCEL_WAIT_S) -> None:
        """A start-up that failed before ``wait_for_weights``: stop the read rather than let it fill
        (and hold) GPU memory for seconds more, beside a retry in the same process."""
        filling, self.filling = self.filling, None
        if filling is not None and not filling.cancel(timeout):
            logger.warning("the weight read of a failed start had not stopped %.0f s after it was asked to", timeout)


# A thread that waits for the GIL gets it after this long while ``quick_gil_handoff`` is held
# (Python's default is 5 ms). See its users: WeightFill and kiln.compiler.background_build.BackgroundBuild.
QUICK_SWITCH_INTERVAL_S = 1e-4
_handoff_lock = threading.Lock()
_handoff_users = 0
_handoff_saved = 0.005


@contextlib.contextmanager
def quick_gil_handoff() -> Iterator[None]:
    """While any thread holds this, the GIL changes hands after ``QUICK_SWITCH_INTERVAL_S``: for
    threads that wait on the GPU, the disk or each other between short stretches of Python, beside
    another thread's long ones. The last to leave restores the interval found by the first."""
    global _handoff_users, _handoff_saved
    with _handoff_lock:
        if _handoff_users == 0:
            _handoff_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_handoff_saved, QUICK_SWITCH_INTERVAL_S))
        _handoff_users += 1
    try:
        yield
    finally:
        with _handoff_lock:
            _handoff_users -= 1
            if _handoff_users == 0:
                sys.setswitchinterval(_handoff_saved)


class Background:
    """``fn()`` on a thread of its own; ``wait()`` returns its result or re-raises its error.

    The tokenizer is built this way on a start from a checkpoint: importing transformers takes
    seconds (more where it pulls in scikit-learn), and it overlaps the weight read, the compile
    cache load and CUDA-graph capture, which wait on the disk and the GPU part of the time."""

    def __init__(self, fn: Callable[[], Any], name: str) -> None:
        self._result: Any = None
        self._error: Optional[BaseException] = None

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as e:  # re-raised by wait(), on the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def join(self, timeout: Optional[float] = None) -> bool:
        """Wait at most ``timeout`` seconds (None: until done); whether ``fn`` has returned or raised."""
        self._thread.join(timeout)
        return self.done

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def error(self) -> Optional[BaseException]:
        """What ``fn`` raised, once done (None while running or after a return)."""
        return self._error


class WeightFill:
    """``model.load_weights(weights)`` on a thread of its own. The model's tensors are allocated
    (empty) before it starts and only their contents change, so the compiler can trace and compile
    the model meanwhile: compiling reads shapes, dtypes and addresses, never values. The reader's
    threads take the GIL back after each chunk read and copied while the main thread runs Python
    (imports, building the model's runtime), so the GIL changes hands quickly meanwhile
    (``quick_gil_handoff``)."""

    def __init__(self, fill: Callable[["WeightFill"], None], device: torch.device) -> None:
        self._error: Optional[BaseException] = None
        self._cancelled = threading.Event()
        self.seconds = 0.0
        on_gpu = device.type == "cuda"

        def run() -> None:
            t0 = time.perf_counter()
            try:
                if on_gpu:
                    torch.cuda.set_device(device)  # the current device is per thread
                with quick_gil_handoff():
                    fill(self)
                    if on_gpu:
                        torch.cuda.synchronize()  # the copies have landed before anyone is told so
                if on_gpu:
                    torch.cuda.empty_cache()  # the read's own tensors: the KV cache is sized after what is in use
            except BaseException as e:  # re-raised by wait(), on the caller's thread
                self._error = e
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="kiln-load-weights", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.seconds

    def tensors(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights``, ending with ``FillCancelled`` at the first tensor after ``cancel``."""
        for item in weights:
            if self._cancelled.is_set():
                raise FillCancelled("the start-up this weight read belongs to failed")
            yield item

    def cancel(self, timeout: float) -> bool:
        """A start-up that failed while the weights were read: stop at the next tensor, close the
        read and wait at most ``timeout`` seconds for the thread to end; whether it has."""
        self._cancelled.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()


class FillCancelled(Exception):
    """Ends the weight read of a start-up that failed (``WeightFill.cancel``)."""


def resolve_device(device: str) -> torch.device:
    """``auto``: CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device=cuda but no CUDA device is available; use model.device=cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (bf16 matmuls are slow there), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    choices = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in choices:
        raise ValueError(f"model.dtype={dtype!r} is not allowed; choose one of ['auto', {', '.join(map(repr, choices))}]")
    return choices[dtype]


def kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``cache.dtype``: auto is the model dtype; fp8 is float8_e4m3fn (with per-layer, per-tensor K
    and V scales: ``kiln.runtime.kv_sizing.allocate_kv_scales``), which CUDA needs SM89+ for; the CPU
    kernel reads it too."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype == "fp8":
        device = torch.device(device)
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("cache.dtype=fp8 needs a GPU of compute capability 8.9 or newer; use cache.dtype=auto")
        return torch.float8_e4m3fn
    raise ValueError(f"cache.dtype={cache_dtype!r} is not allowed; choose one of ['auto', 'fp8']")


def load_model(model_config: ModelConfig, cache_dir: str, device: torch.device, dtype: torch.dtype,
               tp: TensorParallel = SINGLE, kernels: Optional[KernelSet] = None,
               background: bool = False, stage: PipelineStage = WHOLE) -> LoadedModel:
    """The model (this rank's shard under tensor parallelism, of this stage's layers under pipeline
    parallelism), its tokenizer and limits; quantized
    (``model_config.quantization``) into the layouts of ``kernels`` (default: the device's).

    ``background``: where the weights only fill tensors already allocated (a checkpoint of kiln's
    own model family on CUDA, not quantized at load), return while a thread still reads them
    (``LoadedModel.filling``); the caller compiles meanwhile and calls ``wait_for_weights`` before
    the first forward; the read starts before the model is built (``ReadAhead``). Also with
    ``background``, the tokenizer of a checkpoint directory is built
    on a thread (``LoadedModel.tokenizing``); ``wait_for_tokenizer`` hands it over."""
    kernels = kernels or select_kernels(torch.device(device).type)
    spec = model_config.model
    gguf_path = None
    if spec.startswith(RANDOM_PREFIX):
        loaded = _load_random(spec[len(RANDOM_PREFIX):], model_config, cache_dir, device, dtype, tp, stage)
        apply_quantization(loaded.model, resolve_quantization(model_config.quantization, None, None), kernels,
                           group_size=model_config.int4_group_size)
        _prepare_decode(loaded.model, device)
        return loaded
    if spec in REGISTERED_MODELS:
        hf_dir, name = _registered_dir(spec, cache_dir), spec
        gguf_path = REGISTERED_MODELS[spec].find()
    elif os.path.isdir(spec):
        hf_dir, name = spec, os.path.basename(os.path.normpath(spec))
    elif spec.endswith(".gguf") and os.path.isfile(spec):
        name = os.path.basename(spec)[: -len(".gguf")]
        gguf_path = os.path.abspath(spec)
        hf_dir = convert_gguf(gguf_path, cache_dir, name)
    else:
        raise ValueError(f"model={spec!r} is neither a registered model, an existing directory nor a .gguf file. "
                         f"{_choices()}")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"model directory {hf_dir!r} has no config.json; point model= at a Hugging Face "
                         f"checkpoint directory (config.json, *.safetensors, tokenizer files). {_choices()}")
    hf_config = read_json(os.path.join(hf_dir, "config.json"))
    # A vision-language checkpoint (a vision_config beside its text config) takes the generic path,
    # which serves it or refuses it with the reason.
    if "vision_config" in hf_config or use_generic(model_config.impl, hf_config.get("model_type")):
        _check_whole_model(stage)
        return _load_generic(hf_config, hf_dir, name, model_config, device, dtype, tp)
    try:
        arch = ArchConfig.from_hf_config(hf_config)
    except (KeyError, TypeError) as e:  # a field missing, or of the wrong kind
        raise ValueError(f"{os.path.join(hf_dir, 'config.json')!r} does not describe a "
                         f"{hf_config.get('model_type')} model kiln can build: {type(e).__name__} {e}") from None
    arch = dataclasses.replace(arch, eos_token_id=stop_token_ids(hf_dir, arch))
    max_model_len = _max_model_len(model_config, arch)
    tokenizing = None
    if background:
        _check_tokenizer_files(hf_dir)
        tokenizing, tokenizer = Background(lambda: _load_tokenizer(hf_dir), "kiln-load-tokenizer"), None
    else:
        tokenizer = _load_tokenizer(hf_dir)
    scheme = resolve_quantization(model_config.quantization, hf_dir, gguf_path)
    checkpoint_scheme = checkpoint_quantization(hf_dir)
    if stage.size > 1 and scheme != "none":
        raise ValueError(f"a quantized model ({scheme}) does not run with parallel.pipeline_parallel_size="
                         f"{stage.size} yet; set model.quantization=none or parallel.pipeline_parallel_size=1")
    fill = background and scheme == "none" and checkpoint_scheme == "none" and torch.device(device).type == "cuda"
    num_tensors = _num_tensors(hf_dir)  # every shard's header read (an unreadable file refused) before the read
    # On the CPU the tensors are read into the built model's parameters (iter_file_into).
    direct = torch.device(device).type == "cpu" and checkpoint_scheme == "none"
    source = None if direct else iter_safetensors(hf_dir, device)
    if fill:  # the read starts now, while the model is built
        source = ReadAhead(source, _read_ahead_bytes(hf_dir, device), _cuda_device(device))
    try:
        with quick_gil_handoff() if fill else contextlib.nullcontext():  # the read's threads beside it
            model = build_empty_model(arch, device, dtype, tp, stage)
    except BaseException:
        if fill:
            source.close()
        raise
    if direct:
        source = iter_safetensors(hf_dir, device, model.weight_destinations())
    kv_scales: dict[int, list[float]] = {}
    weights = collect_kv_scales(source, kv_scales)
    int4_projections = None
    if checkpoint_scheme == "fp8":  # any scheme: FP8 tensors load dequantized first
        weights = dequantize_fp8_checkpoint(weights, dtype)
    elif checkpoint_scheme == "int4":  # AWQ/GPTQ: float weights for load_weights, the int4 kept aside for int4
        int4_projections = {} if scheme == "int4" else None
        weights = dequantize_int4_checkpoint(weights, checkpoint_int4_format(hf_dir), dtype, int4_projections)
    weights = progress_bar(weights, desc=f"loading {name}", total=num_tensors, unit="tensor")
    if fill:
        model.quantization = "none"
        return LoadedModel(model, arch, tokenizer, name, hf_dir, max_model_len,
                           WeightFill(lambda fill: _load_then_close(model, fill.tensors(weights), source),
                                      next(model.parameters()).device),
                           kv_scales=kv_scales, tokenizing=tokenizing)
    model.load_weights(weights)
    apply_quantization(model, scheme, kernels, gguf_path if tp.size == 1 else None, int4_projections,
                       model_config.int4_group_size)
    _prepare_decode(model, device, gguf_path if tp.size == 1 else None)
    return LoadedModel(model, arch, tokenizer, name, hf_dir, max_model_len, kv_scales=kv_scales, tokenizing=tokenizing)


def _load_then_close(model, weights: Iterable[tuple[str, torch.Tensor]], source: ReadAhead) -> None:
    try:
        model.load_weights(weights)
    finally:  # also when a tensor does not fit: the read's thread stops and its tensors go
        source.close()


def _prepare_decode(model, device, gguf_path: Optional[str] = None) -> None:
    if torch.device(device).type == "cpu":
        from kiln.models.quantize import read_gguf_head_q8_0
        from kiln.ops.cpu_linear import prepare_cpu_decode

        quantized = getattr(model, "quantization", "none") in ("int8", "int4")
        head_blocks = None
        if quantized and gguf_path is not None:  # the head in the GGUF's own Q8_0 blocks, if stored so
            head_blocks = read_gguf_head_q8_0(gguf_path, tied=getattr(model, "lm_head", None) is None)
        prepare_cpu_decode(model, head_blocks)


def use_generic(impl: str, model_type: Optional[str]) -> bool:
    """``model.impl``: transformers' modeling code (the generic path) or kiln's own? ``auto`` takes
    kiln's own where it implements the family (``arch.FAMILIES``)."""
    if impl == "transformers":
        return True
    if impl == "native":
        if model_type not in FAMILIES:
            raise ValueError(f"model.impl=native: kiln has no native implementation of model_type {model_type!r} "
                             f"(it has {list(FAMILIES)}); use model.impl=auto or transformers for the generic path")
        return False
    return model_type not in FAMILIES


def _load_generic(hf_config: dict, hf_dir: str, name: str, model_config: ModelConfig, device, dtype,
                  tp: TensorParallel) -> LoadedModel:
    """The generic path: transformers' model of ``config.json``, weights from the directory."""
    config = hf_config_from_dict(hf_config)
    build = build_vision_generic if is_vision_config(config) else build_generic
    model = build(config, device, dtype, tp.size)
    model.arch = dataclasses.replace(model.arch, eos_token_id=stop_token_ids(hf_dir, model.arch))
    max_model_len = _max_model_len(model_config, model.arch)
    tokenizer = _load_tokenizer(hf_dir)
    model.load_weights(progress_bar(iter_safetensors(hf_dir, device), desc=f"loading {name}", total=_num_tensors(hf_dir),
                                    unit="tensor"))
    return LoadedModel(model, model.arch, tokenizer, name, hf_dir, max_model_len)


def _check_whole_model(stage: PipelineStage) -> None:
    if stage.size > 1:
        raise ValueError(f"the generic path (transformers' modeling code) runs whole models only, not "
                         f"parallel.pipeline_parallel_size={stage.size}; set it to 1, or model.impl=native "
                         "for a family kiln implements")


def build_empty_model(arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                      tp: TensorParallel = SINGLE, stage: PipelineStage = WHOLE) -> LlamaForCausalLM:
    """The model (this stage's layers) with uninitialized weights allocated once, on ``device`` in ``dtype``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, tp, stage)
    # to_empty's empty_like of a meta tensor runs torch's Python reference of it, which imports sympy
    # (a second of a start on a GPU machine); the tensors are contiguous, so torch.empty is the same.
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.reset_rope_cache()
    return model.eval().requires_grad_(False)


@torch.no_grad()
def init_random_weights(model: LlamaForCausalLM, seed: int, std: float = RANDOM_INIT_STD) -> None:
    """Fill ``model`` (any rank's shard, any stage) with the random model named by ``seed``: each
    rank loads its slice of the same full tensors, so every tensor- and pipeline-parallel size
    holds the same model. A stage draws only its own tensors."""
    param = next(model.parameters())
    names = model.weight_names()
    weights = iter_random_weights(model.arch, seed, param.device, param.dtype, std, names)
    num_tensors = len(names)
    model.load_weights(progress_bar(weights, desc="drawing random weights", total=num_tensors, unit="tensor"))


def iter_random_weights(arch: ArchConfig, seed: int, device: torch.device, dtype: torch.dtype,
                        std: float = RANDOM_INIT_STD, names: Optional[set[str]] = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every weight of a random ``arch`` model (those in ``names``
    only, where given), drawn on ``device``.

    Norm weights are 1, everything else N(0, std): finite, non-degenerate logits at any depth,
    since every layer's input is renormalized. Each tensor has its own generator, seeded from
    (seed, name), so a tensor never depends on which others a rank draws, and only one full
    tensor exists at a time (``load_weights`` keeps its slice and drops it)."""
    with torch.device("meta"):
        shapes = [(name, t.shape) for name, t in LlamaForCausalLM(arch).weight_targets()
                  if names is None or name in names]
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device, dtype=dtype)
        else:
            generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
            yield name, torch.empty(shape, device=device, dtype=dtype).normal_(0.0, std, generator=generator)


def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (model seed, tensor name), the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


# A start from a checkpoint on CUDA reads up to this much ahead of the model's construction (about a
# second of reading from the page cache; see ReadAhead). Beside the whole checkpoint, this much of
# the GPU's free memory is left alone.
READ_AHEAD_MAX_BYTES = 8 << 30
READ_AHEAD_MARGIN_BYTES = 2 << 30


def iter_safetensors(hf_dir: str, device: Union[str, torch.device] = "cpu",
                     destinations: Optional[dict[str, torch.Tensor]] = None
                     ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """(name, tensor on ``device``) for every tensor of the checkpoint. On CUDA the files are read
    by several threads through pinned buffers straight into GPU memory (``weight_reader``): no CPU
    copy of the weights is made. On the CPU, safetensors maps one shard at a time, and a tensor
    with a place in ``destinations`` (a model's ``weight_destinations``) is read into it and given
    as (name, None)."""
    device = torch.device(device)
    paths = [os.path.join(hf_dir, fname) for fname in _safetensors_files(hf_dir)]
    if device.type == "cuda":
        yield from iter_files_to_device(paths, _cuda_device(device))
        return
    for path in paths:
        yield from iter_file_into(path, destinations or {})


def _cuda_device(device: Union[str, torch.device]) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.index is None else device


def _read_ahead_bytes(hf_dir: str, device: Union[str, torch.device]) -> int:
    """How much of a checkpoint may be read into GPU memory before the model it fills exists: up to
    ``READ_AHEAD_MAX_BYTES``, within what is free beside the whole checkpoint and a margin."""
    free, _ = torch.cuda.mem_get_info(_cuda_device(device))
    checkpoint = sum(os.path.getsize(os.path.join(hf_dir, f)) for f in _safetensors_files(hf_dir))
    return max(0, min(READ_AHEAD_MAX_BYTES, free - checkpoint - READ_AHEAD_MARGIN_BYTES))


def _safetensors_files(hf_dir: str) -> list[str]:
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index!r} is not a safetensors index (a JSON object with a weight_map of tensor "
                             f"to file): {type(e).__name__}: {e}") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
        if missing:
            raise ValueError(f"model directory {hf_dir!r} lacks {len(missing)} of the weight files its index names "
                             f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); fetch them again")
    else:
        files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"model directory {hf_dir!r} has no *.safetensors weights (other formats are not supported)")
    return files


def _num_tensors(hf_dir: str) -> int:
    """The checkpoint's tensor count, for the progress bar: only each shard's header is read."""
    num = 0
    for fname in _safetensors_files(hf_dir):
        with open_safetensors(os.path.join(hf_dir, fname)) as f:
            num += len(f.keys())
    return num


def _load_random(preset: str, model_config: ModelConfig, cache_dir: str, device, dtype,
                 tp: TensorParallel, stage: PipelineStage = WHOLE) -> LoadedModel:
    if preset not in PRESETS:
        raise ValueError(f"unknown random preset {preset!r}. {_choices()}")
    tokenizer = _load_tokenizer(tokenizer_dir(cache_dir))
    # Stop tokens must be ids the borrowed tokenizer knows.
    arch = dataclasses.replace(PRESETS[preset], bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=(tokenizer.eos_token_id,))
    if use_generic(model_config.impl, arch.family):
        _check_whole_model(stage)
        # The same random weights (same names, same seeds) in transformers' model of the preset.
        model = build_generic(hf_config_from_dict(arch.to_hf_config()), device, dtype, tp.size)
        model.load_weights(progress_bar(iter_random_weights(arch, model_config.seed, device, dtype),
                                        desc="drawing random weights", unit="tensor"))
    else:
        model = build_empty_model(arch, device, dtype, tp, stage)
        init_random_weights(model, model_config.seed)
    max_model_len = _max_model_len(model_config, arch)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # else the KV cache sizing counts the freed full tensors as in use
    return LoadedModel(model, arch, tokenizer, RANDOM_PREFIX + preset, None, max_model_len)


def describe_quantization(model_config: ModelConfig) -> str:
    """What ``model.quantization`` resolves to for this model and why, for the start line, without
    loading or converting anything; empty for a random preset left unquantized."""
    spec, gguf_path, hf_dir = model_config.model, None, None
    if spec in REGISTERED_MODELS:
        gguf_path = REGISTERED_MODELS[spec].find()
    elif spec.endswith(".gguf") and os.path.isfile(spec):
        gguf_path = spec
    elif os.path.isdir(spec):
        hf_dir = spec
    elif not spec.startswith(RANDOM_PREFIX):
        return ""  # the load says what is wrong with it
    scheme, why = quantization_choice(model_config.quantization, hf_dir, gguf_path)
    if spec.startswith(RANDOM_PREFIX) and scheme == "none":
        return ""
    return f"weights {'unquantized' if scheme == 'none' else scheme} ({why})"


def _registered_dir(name: str, cache_dir: str) -> str:
    source = REGISTERED_MODELS[name]
    path = source.find()
    if path is None:
        raise ValueError(f"model={name!r} needs the package {source.package!r} ({source.install_hint}); "
                         "or pass a local Hugging Face directory or a random:<preset> instead")
    return convert_gguf(path, cache_dir, name)


def tokenizer_dir(cache_dir: str) -> str:
    """The tokenizer directory a random preset borrows: ``$KILN_TOKENIZER_DIR``, else the donor model's."""
    env_dir = os.environ.get(TOKENIZER_DIR_ENV)
    if env_dir:
        return env_dir
    source = REGISTERED_MODELS[TOKENIZER_DONOR]
    path = source.find()
    if path is None:
        raise ValueError(f"random presets borrow the {TOKENIZER_DONOR} tokenizer: install {source.package!r} "
                         f"({source.install_hint}) or set ${TOKENIZER_DIR_ENV} to a tokenizer directory")
    return convert_gguf_tokenizer(path, cache_dir, TOKENIZER_DONOR)


def _check_tokenizer_files(path: str) -> None:
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ValueError(f"{path!r} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")


# tokenizer_config.json classes that are transformers' generic fast tokenizer over tokenizer.json, and
# the model types (None: no config.json) for which AutoTokenizer picks that class as named.
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
_GENERIC_TOKENIZER_MODEL_TYPES = (None, "llama")


def read_json(path: str) -> dict:
    """A checkpoint's JSON file (config.json and the like) as a dict; one that is cut short or not
    a JSON object is a ValueError naming it."""
    try:
        with open(path) as f:
            value = json.load(f)
    except ValueError as e:
        raise ValueError(f"{path!r} is not valid JSON ({e}); an interrupted download or copy? fetch it again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path!r} holds a JSON {type(value).__name__}, not an object")
    return value


def _generic_fast_tokenizer(path: str) -> bool:
    """Whether ``AutoTokenizer.from_pretrained(path)`` would build transformers' generic fast
    tokenizer from tokenizer.json (the class tokenizer_config.json names, no custom code)."""
    def read(name: str) -> Optional[dict]:
        file = os.path.join(path, name)
        return read_json(file) if os.path.isfile(file) else None

    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    tokenizer_config, config = read("tokenizer_config.json") or {}, read("config.json") or {}
    return (tokenizer_config.get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES and "auto_map" not in tokenizer_config
            and config.get("model_type") in _GENERIC_TOKENIZER_MODEL_TYPES and "auto_map" not in config)


def _load_tokenizer(path: str) -> Any:
    _check_tokenizer_files(path)
    import_transformers()  # on a thread of its own at start-up, maybe beside another
    try:
        if _generic_fast_tokenizer(path):
            # The class AutoTokenizer would pick, without importing AutoTokenizer: that imports every model
            # family's modeling code (and scikit-learn where it is installed), seconds of a start-up.
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except ImportError:
        raise
    except Exception as e:  # tokenizers' parse errors are plain Exceptions: name the directory
        raise ValueError(f"cannot build the tokenizer of {path!r} ({type(e).__name__}: {first_line(e)}); are its "
                         "tokenizer files complete?") from e


def stop_token_ids(hf_dir: str, arch: ArchConfig) -> tuple[int, ...]:
    """Every id that ends a request: config.json's ``eos_token_id`` (one id or a list) and then
    generation_config.json's, which transformers' ``generate`` stops on (Llama 3.1 Instruct lists
    <|end_of_text|>, <|eom_id|> and <|eot_id|> there)."""
    ids = list(arch.eos_token_id)
    path = os.path.join(hf_dir, "generation_config.json")
    if os.path.isfile(path):
        eos = read_json(path).get("eos_token_id")
        for e in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if int(e) not in ids:
                ids.append(int(e))
    return tuple(ids)


def _max_model_len(model_config: ModelConfig, arch: ArchConfig) -> int:
    context = arch.context_limit
    limit = model_config.max_model_len or context
    if limit > context:
        why = "" if context == arch.max_position_embeddings else (
            " (dynamic NTK RoPE is served up to its trained length, where it matches transformers)")
        raise ValueError(f"model.max_model_len={limit} exceeds the model's context length {context}{why}; "
                         "lower it or leave it unset")
    return limit


def _choices() -> str:
    return (f"Choose a registered model {sorted(REGISTERED_MODELS)}, a local Hugging Face directory, a .gguf file, "
            f"or random:<preset> with preset in {sorted(PRESETS)}.")
