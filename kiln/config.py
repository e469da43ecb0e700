"""Configuration: one frozen dataclass per subsystem, composed into EngineConfig.

Rules kept here:
- A component receives only its own sub-config, never EngineConfig.
- Every dataclass validates itself in ``__post_init__`` and names the field and the allowed values.
- Hydra stays at the edge: the CLI registers these dataclasses in its ConfigStore; nothing below the
  entry points sees a DictConfig.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional


def _check_choice(owner: str, name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}.{name}={value!r} is not allowed; choose one of {list(allowed)}")


def _check_positive(owner: str, name: str, value: Optional[float], allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


# What saved configs and logs show in place of a secret (a field with metadata {"secret": True}).
REDACTED = "***"
API_KEY_ENV = "KILN_API_KEY"


def redacted(config: Any) -> dict:
    """``dataclasses.asdict(config)`` with every secret that is set replaced by REDACTED: the form
    of a config that may be written to disk or logged."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            value = redacted(value)
        elif f.metadata.get("secret") and value:
            value = REDACTED
        out[f.name] = value
    return out


def default_cache_dir() -> str:
    return os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")


QUANTIZATIONS = ("none", "auto", "int8", "int4", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    """Which model to load and how.

    ``model`` is a registered name (``smollm2-135m-instruct``), a local Hugging Face directory, or
    ``random:<preset>``.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: Optional[int] = None  # None: the model's own context length
    seed: int = 0  # seed of random weights and of unseeded sampling
    # auto: kiln's own implementation when it has the family, else transformers' modeling code
    # (native | transformers force one; see kiln.models.hf_generic).
    impl: str = "auto"

    # auto: the checkpoint's own (its quantization_config; a GGUF file its blocks: Q4_0/Q4_1/Q4_K as
    # int4, Q8_0 as int8) | none (dequantized, the model dtype) | int8 | int4 (weight-only) | fp8
    # (weights and activations). Random presets take any of them; auto leaves them unquantized.
    quantization: str = "auto"
    # Input columns per scale and zero of int4 weights quantized at load (from a bf16/fp32 checkpoint
    # or a random preset); a linear whose in_features it does not divide takes the largest group that
    # does. Checkpoints that bring their own groups (AWQ, GPTQ, the GGUF's blocks) keep theirs.
    int4_group_size: int = 32

    def __post_init__(self) -> None:
        _check_choice("model", "dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice("model", "impl", self.impl, ("auto", "native", "transformers"))
        _check_choice("model", "quantization", self.quantization, QUANTIZATIONS)
        _check_choice("model", "device", self.device, ("auto", "cpu", "cuda"))
        if self.int4_group_size < 2 or self.int4_group_size % 2:
            raise ValueError(f"model.int4_group_size must be an even number of columns >= 2, got {self.int4_group_size}")
        _check_positive("model", "max_model_len", self.max_model_len, allow_none=True)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizing and the on-disk cache directory (converted weights, compiled artifacts)."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_gib: Optional[float] = None  # None: CPU 1 GiB budget, GPU from gpu_memory_fraction
    gpu_memory_fraction: float = 0.9
    num_blocks: Optional[int] = None  # overrides the memory budget (tests use tiny pools)
    dir: Optional[str] = None  # None: $KILN_CACHE_DIR or ~/.cache/kiln
    # KV cache element type: auto (the model dtype) | fp8 (float8_e4m3fn: twice the tokens of a bf16
    # cache in the same memory; GPUs of SM89+ or the CPU). An FP8 cache has per-layer k/v scales: the
    # checkpoint's (k_scale / v_scale), else 1, unless calculate_kv_scales sets them.
    dtype: str = "auto"
    # FP8 cache only: set each layer's scales from the first prefill's amax (/ 448, with 2x
    # headroom), then keep them: for bf16 checkpoints whose K or V leave e4m3's range at scale 1.
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        _check_positive("cache", "block_size", self.block_size)
        _check_choice("cache", "dtype", self.dtype, ("auto", "fp8"))
        if self.calculate_kv_scales and self.dtype != "fp8":
            raise ValueError("cache.calculate_kv_scales=true needs cache.dtype=fp8 (only an FP8 cache has scales)")
        _check_positive("cache", "kv_cache_memory_gib", self.kv_cache_memory_gib, allow_none=True)
        _check_positive("cache", "num_blocks", self.num_blocks, allow_none=True)
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ValueError(f"cache.gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}")

    @property
    def resolved_dir(self) -> str:
        return self.dir or default_cache_dir()


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy. ``None``: sized for the device (``resolve_for_device``)."""

    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # fcfs | priority (lower value first, then arrival)

    def __post_init__(self) -> None:
        _check_positive("scheduler", "max_num_seqs", self.max_num_seqs, allow_none=True)
        _check_positive("scheduler", "max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)
        _check_choice("scheduler", "policy", self.policy, ("fcfs", "priority"))

    @property
    def is_resolved(self) -> bool:
        return self.max_num_seqs is not None and self.max_num_batched_tokens is not None


COMPILE_MODES = ("auto", "eager", "stock", "kiln")
CUDAGRAPH_MODES = ("auto", "none", "piecewise", "full", "full_and_piecewise")
# What is ready before the engine says ready (compile.startup); docs/decisions/startup-policy.md.
# complete: kiln's forward built (or loaded from the compile cache) and every CUDA graph captured.
# fast: ready once the weights are placed; the forward builds on a thread while steps run eagerly,
#   and CUDA graphs are captured between steps once it is built.
# auto: the forward before ready when the compile cache holds it (a warm start loads it in about a
#   second), else on a thread (a cold start serves eagerly while it compiles); the smallest decode
#   graphs before ready, every other size captured between steps, first the sizes a step asked for.
STARTUP_POLICIES = ("auto", "complete", "fast")
# Keys compile.startup replaced; naming one is an error that says so.
REPLACED_BY_STARTUP = ("capture", "build", "max_startup_capture_size")
# How a resolved config builds kiln's forward (ResolvedCompileConfig.build).
BUILD_PLANS = ("startup", "background", "background_when_cold")
# Capture sizes up to this are captured before ready where the rest wait for the steps (the first
# requests' decodes).
STARTUP_CAPTURE_MAX = 8


def replaced_by_startup(key: str) -> str:
    """The error for one of the keys compile.startup replaced."""
    return (f"{key} is gone: set compile.startup, which says what is built before ready (complete: "
            f"everything, as build=startup capture=startup did; fast: ready once the weights are placed, "
            f"as build=background capture=lazy did; auto: the default)")


@dataclass(frozen=True)
class CompileConfig:
    """How the model is compiled: ``mode`` (COMPILE_MODES) times ``cudagraph`` (CUDAGRAPH_MODES).

    See docs/architecture.md (``kiln/compiler/``) for what each mode builds and how a step picks a graph.
    """

    mode: str = "auto"  # auto: resolve_for_device picks (kiln; a first CPU start builds it in the background)
    cudagraph: str = "auto"  # auto: full_and_piecewise on CUDA, none on the CPU
    sizes: tuple[int, ...] = ()  # extra sizes Inductor specializes for
    capture_sizes: Optional[tuple[int, ...]] = None  # None: default_capture_sizes(max_num_seqs, max tokens)
    startup: str = "auto"  # STARTUP_POLICIES: what is built before the engine is ready
    # kiln mode: cut the graph at every split_every-th attention call (0: never; one piece), the
    # others compiled inside the pieces. 1 (every call) is what piecewise CUDA graphs need. None:
    # decided per device (default_split_every).
    split_every: Optional[int] = None
    # CUDA: a background build's Python waits while a step runs (StepGate); false: it does not (to measure).
    build_gate: bool = True
    debug_dump_dir: Optional[str] = None

    def __post_init__(self) -> None:
        _check_choice("compile", "mode", self.mode, COMPILE_MODES)
        _check_choice("compile", "cudagraph", self.cudagraph, CUDAGRAPH_MODES)
        _check_choice("compile", "startup", self.startup, STARTUP_POLICIES)
        if self.split_every is not None and int(self.split_every) < 0:
            raise ValueError(f"compile.split_every must be >= 0 (0: one piece), got {self.split_every}")
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if self.capture_sizes is not None:
            sizes = tuple(sorted({int(s) for s in self.capture_sizes}))
            if any(s <= 0 for s in sizes):
                raise ValueError(f"compile.capture_sizes must be positive, got {list(self.capture_sizes)}")
            object.__setattr__(self, "capture_sizes", sizes)

    @property
    def is_resolved(self) -> bool:
        return False


@dataclass(frozen=True)
class ResolvedCompileConfig(CompileConfig):
    """A CompileConfig with every ``auto`` decided for one device and entrypoint (``resolve_for_device``):
    what every component reads. ``startup`` becomes ``build`` and ``capture``."""

    build: str = "startup"  # BUILD_PLANS: before ready, on a thread, or on a thread only on a cache miss
    capture: str = "startup"  # startup: every CUDA graph size before ready; lazy: up to startup_capture_max
    startup_capture_max: int = STARTUP_CAPTURE_MAX

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("compile", "build", self.build, BUILD_PLANS)
        _check_choice("compile", "capture", self.capture, ("startup", "lazy"))
        if int(self.startup_capture_max) < 0:
            raise ValueError(f"startup_capture_max must be >= 0, got {self.startup_capture_max}")

    @property
    def is_resolved(self) -> bool:
        return True


# The names the server's parsers know (kiln.entrypoints.openai.tool_calls and .reasoning hold them).
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral", "qwen3_coder", "qwen3_xml", "pythonic",
                     "llama4_pythonic", "deepseek_v3", "deepseek_v31")
REASONING_PARSERS = ("deepseek_r1", "qwen3", "deepseek_v3", "minimax_m2", "glm45", "mistral", "seed_oss")


@dataclass(frozen=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server."""

    host: str = "127.0.0.1"
    port: int = 8000
    # A secret (never in repr, saved configs or logs): better given as $KILN_API_KEY or in
    # api_key_file. A saved config shows REDACTED instead; see resolved_api_key.
    api_key: Optional[str] = field(default=None, repr=False, metadata={"secret": True})
    api_key_file: Optional[str] = None  # a file whose first line is the API key
    served_model_name: Optional[str] = None
    # LoRA adapters served from the start, each "name=path" (a PEFT directory); a request picks one
    # with "model": name. Turns lora.enabled on.
    lora_modules: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_request_bytes: int = 1 << 20
    # Host headers served (against DNS rebinding): names, "*.example.com" suffixes; "*": any.
    allowed_hosts: tuple[str, ...] = ("*",)
    # What one request may ask for: prompts in a completion, and sequences (prompts x n); over: 400.
    max_prompts_per_request: int = 1024
    max_seqs_per_request: int = 1024
    # Backpressure: sequences, and their prompt tokens (each of n counts), admitted and not yet
    # finished, running or waiting; a request that would pass either gets a 429.
    max_queued_seqs: int = 4096
    max_queued_tokens: int = 1 << 22
    # Slow clients: a request's headers, then its whole body, must arrive within these of its first
    # byte (else the connection closes, or a 408); an idle keep-alive connection closes after the last.
    header_read_timeout_s: float = 10.0
    body_read_timeout_s: float = 60.0
    keep_alive_timeout_s: float = 5.0
    # How the model writes tool calls: auto (by its chat template) or one of TOOL_CALL_PARSERS.
    tool_call_parser: str = "auto"
    # How a reasoning model marks its thinking (REASONING_PARSERS, vLLM's names); null: no split.
    reasoning_parser: Optional[str] = None
    # With a reasoning parser, structured outputs constrain the thinking too (vLLM's
    # enable_in_reasoning); by default they start after the thinking's end marker.
    structured_outputs_in_reasoning: bool = False
    # Frontend processes (HTTP, tokenizing, detokenizing, SSE) on the one port, all in front of one
    # engine core; the queue limits above are split evenly between them, and /metrics adds up.
    api_server_count: int = 1
    # Images in chat content parts: data URLs always; http(s) URLs only from these hosts (fetched
    # within media_fetch_timeout_s, at most max_media_bytes); file:// URLs only under this directory.
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: Optional[str] = None
    media_fetch_timeout_s: float = 5.0
    max_media_bytes: int = 20 << 20
    # An image's width x height (decompression bombs included), and images per request; over: 400.
    max_image_pixels: int = 4096 * 4096
    limit_mm_per_prompt: int = 8

    def __post_init__(self) -> None:
        _check_choice("server", "tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        object.__setattr__(self, "allowed_media_domains", tuple(self.allowed_media_domains))
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"server.reasoning_parser={self.reasoning_parser!r} is not a known reasoning parser; "
                             f"known: {', '.join(REASONING_PARSERS)} (or null: no parsing)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"server.port must be in [0, 65535], got {self.port}")
        object.__setattr__(self, "cors_origins", tuple(self.cors_origins))
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
        for entry in self.lora_modules:
            if "=" not in entry or not entry.split("=", 1)[0] or not entry.split("=", 1)[1]:
                raise ValueError(f"server.lora_modules entry {entry!r} must be name=path (a PEFT adapter directory)")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))
        if not self.allowed_hosts:
            raise ValueError('server.allowed_hosts is empty, which would refuse every request; ["*"] allows any host')
        if self.api_key not in (None, "", REDACTED) and self.api_key_file:
            raise ValueError("give server.api_key or server.api_key_file, not both")
        for name in ("max_prompts_per_request", "max_seqs_per_request", "max_queued_seqs", "max_queued_tokens",
                     "header_read_timeout_s", "body_read_timeout_s", "keep_alive_timeout_s", "api_server_count",
                     "media_fetch_timeout_s", "max_media_bytes", "max_image_pixels", "limit_mm_per_prompt"):
            _check_positive("server", name, getattr(self, name))

    def resolved_api_key(self) -> Optional[str]:
        """The key every /v1 route wants: ``api_key``, else the first line of ``api_key_file``, else
        $KILN_API_KEY, else None (no auth). ``api_key == REDACTED`` (a config read back from a saved
        copy) says a key was given elsewhere: then the file or the environment must hold it."""
        if self.api_key and self.api_key != REDACTED:
            return self.api_key
        if self.api_key_file:
            try:
                with open(self.api_key_file, encoding="utf-8") as f:
                    key = f.readline().strip()
            except OSError as e:
                raise ValueError(f"server.api_key_file={self.api_key_file!r} cannot be read: {e.strerror}") from e
            if not key:
                raise ValueError(f"server.api_key_file={self.api_key_file!r} holds no key on its first line")
            return key
        key = os.environ.get(API_KEY_ENV) or None
        if key is None and self.api_key == REDACTED:
            raise ValueError(f"server.api_key is {REDACTED} (redacted) and neither server.api_key_file nor "
                             f"${API_KEY_ENV} gives the key")
        return key

    def secret_env(self) -> dict[str, str]:
        """The environment that hands this config's secrets to a child process that reads its
        ``redacted`` copy (where api_key is REDACTED)."""
        return {API_KEY_ENV: self.api_key} if self.api_key and self.api_key != REDACTED else {}


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split across devices."""

    tensor_parallel_size: int = 1
    # Stages the layers are split over, one after the other (pipeline parallelism): stage 0 embeds,
    # the last one holds the final norm, LM head and sampler; ranks are tp x pp, tp fastest.
    pipeline_parallel_size: int = 1
    backend: str = "uni"  # uni | mp | ray
    # A rank silent this long in one step (hung, deadlocked in a collective) fails the engine.
    step_timeout_s: float = 300.0
    # nccl | symm_mem: small all-reduces through PyTorch symmetric memory (CUDA, one host), NCCL above.
    all_reduce: str = "nccl"
    # ray: how the placement group lays the ranks (one bundle each) over nodes; PACK fills a node first.
    placement_strategy: str = "PACK"  # PACK | STRICT_PACK | SPREAD | STRICT_SPREAD
    # Engine cores (replicas, each its own process and KV cache) behind one server, which balances
    # requests by load and prefix-cache affinity (kiln.engine.dp_client); replica i takes GPU i.
    data_parallel_size: int = 1
    # Mixture-of-experts models: place the experts whole across the tensor-parallel ranks (expert
    # parallelism) instead of cutting each along its intermediate dimension.
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _check_positive("parallel", "tensor_parallel_size", self.tensor_parallel_size)
        if self.enable_expert_parallel and self.tensor_parallel_size == 1:
            raise ValueError("parallel.enable_expert_parallel places experts across the tensor-parallel ranks; "
                             "set parallel.tensor_parallel_size above 1 (and parallel.backend=mp or ray)")
        _check_positive("parallel", "pipeline_parallel_size", self.pipeline_parallel_size)
        _check_positive("parallel", "data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and (self.world_size != 1 or self.backend != "uni"):
            raise ValueError(f"parallel.data_parallel_size={self.data_parallel_size} runs each replica in one "
                             "process for now (parallel.tensor_parallel_size=1, parallel.pipeline_parallel_size=1, "
                             "parallel.backend=uni); set parallel.data_parallel_size=1 to split the model instead")
        _check_positive("parallel", "step_timeout_s", self.step_timeout_s)
        _check_choice("parallel", "all_reduce", self.all_reduce, ("nccl", "symm_mem"))
        _check_choice("parallel", "backend", self.backend, ("uni", "mp", "ray"))
        _check_choice("parallel", "placement_strategy", self.placement_strategy,
                      ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"))
        if self.pipeline_parallel_size > 1 and self.all_reduce == "symm_mem":
            raise ValueError("parallel.all_reduce=symm_mem reduces over every rank, not one stage's; with "
                             f"parallel.pipeline_parallel_size={self.pipeline_parallel_size} use all_reduce=nccl")
        if self.pipeline_parallel_size > 1 and self.backend == "uni":
            raise ValueError(f"parallel.pipeline_parallel_size={self.pipeline_parallel_size} runs one process per "
                             "stage: set parallel.backend=mp (or ray)")

    @property
    def world_size(self) -> int:
        """Ranks the model runs on: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPECULATIVE_METHODS = ("none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses up to ``num_speculative_tokens`` tokens per decoding
    request, and the target model checks them all in one forward (``kiln.runtime.spec_decode``).

    ``ngram`` looks the last ``prompt_lookup_max``..``prompt_lookup_min`` tokens up earlier in the
    request's own context and proposes what followed them; ``draft`` runs ``draft_model`` (any model
    kiln loads with the target's vocabulary) greedily for k steps, with its own compile settings and
    its own KV cache in the same block budget. Above ``max_batch_size`` decoding requests in a step,
    speculation is off for that step (verifying costs more than it saves in a compute-bound batch).
    """

    method: str = "none"
    num_speculative_tokens: int = 4  # k: proposed tokens per request and step
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: the longest suffix looked up (longest match wins)
    draft_model: Optional[str] = None  # draft: a registered name, a Hugging Face directory or random:<preset>
    draft_dtype: str = "auto"  # draft: auto: the target's dtype
    draft_compile_mode: str = "eager"  # draft: compile.mode of the draft model
    draft_cudagraph: str = "auto"  # draft: compile.cudagraph of the draft model (auto: full graphs on CUDA)
    # Speculate only while at most this many requests run: on an H100 (Llama-3-8B shapes, k = 4) a
    # verify step costs 1.04x a decode at batch 1 and 1.25x at 32, and at per-token acceptance 0.7
    # the speed-up fell from 2.1x at batch 1 to 1.04x at 16 and 0.88x at 32 (python -m benchmarks.offline spec-decode).
    max_batch_size: int = 16

    def __post_init__(self) -> None:
        _check_choice("speculative", "method", self.method, SPECULATIVE_METHODS)
        _check_positive("speculative", "num_speculative_tokens", self.num_speculative_tokens)
        _check_positive("speculative", "prompt_lookup_min", self.prompt_lookup_min)
        _check_positive("speculative", "max_batch_size", self.max_batch_size)
        _check_choice("speculative", "draft_dtype", self.draft_dtype, ("auto", "float32", "bfloat16", "float16"))
        _check_choice("speculative", "draft_compile_mode", self.draft_compile_mode, COMPILE_MODES)
        _check_choice("speculative", "draft_cudagraph", self.draft_cudagraph, CUDAGRAPH_MODES)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative.prompt_lookup_max={self.prompt_lookup_max} is below "
                             f"prompt_lookup_min={self.prompt_lookup_min}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def draft_compile(self) -> CompileConfig:
        return CompileConfig(mode=self.draft_compile_mode, cudagraph=self.draft_cudagraph)


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA: PEFT adapters of the base model served beside it, chosen per request
    (``LoRARequest``; ``kiln.models.lora``). ``max_loras`` adapters sit in device slots at once (a
    step mixes any of them with the base model), up to ``max_cpu_loras`` more stay loaded on the
    host (least recently used dropped first). Off unless ``enabled`` (``LLM(lora={...})`` and
    ``server.lora_modules`` turn it on)."""

    enabled: bool = False
    max_loras: int = 4  # device slots: distinct adapters in one step
    max_lora_rank: int = 64  # the largest adapter rank r; the slots' size
    max_cpu_loras: Optional[int] = None  # adapters kept loaded on the host; None: max_loras

    def __post_init__(self) -> None:
        _check_positive("lora", "max_loras", self.max_loras)
        _check_positive("lora", "max_lora_rank", self.max_lora_rank)
        _check_positive("lora", "max_cpu_loras", self.max_cpu_loras, allow_none=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"lora.max_cpu_loras={self.max_cpu_loras} is below lora.max_loras={self.max_loras}: "
                             "every adapter in a device slot is also kept on the host")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


PDL_SETTINGS = ("on", "off", "gemm")
DECODE_MERGES = ("fused", "kernel")
GEMV_JOIN_SCHEMES = ("fp8", "dense", "int4")  # in the order a KernelSet lists its joins


@dataclass(frozen=True)
class KernelConfig:
    """Switches inside kiln's CUDA kernels (``kernels.*``; ``LLM(kernels={...})``). Every process of an
    engine runs with the same one (``kiln.ops.options``); the ops read it when the KernelSet is chosen,
    when graphs are traced and captured, and at launch. The defaults are the measured choices
    (docs/decisions/one-row-decode-kernels.md); a key "to measure" exists to time the other way."""

    # Programmatic dependent launch of kiln's Triton kernels on SM90+ (kiln.ops.pdl): on | off |
    # gemm (the weight-only GEMVs alone; to measure each part).
    pdl: str = "on"
    # The schemes whose one-row GEMV computes its input from the add + RMSNorm or SiLU-and-mul that
    # feeds it (kiln.ops.triton_joined_linear): dense; fp8 and int4 measured no faster joined; ()
    # joins none (to measure). Changes the compiled graph.
    gemv_join: tuple[str, ...] = ("dense",)
    # Dense bf16/fp16 linears at one row through kiln's Triton GEMV (kiln.ops.dense_linear); false
    # keeps cuBLAS, to measure.
    dense_gemv: bool = True
    # Split-K decode attention: fused (the last split to finish merges the others) | kernel (a merge
    # launch of its own, to measure).
    decode_merge: str = "fused"
    # The decode kernel stores the new K/V itself in a decode-only batch of at most this many
    # (decode, kv head) pairs (kiln.ops.triton_attention says why 256); 0: never, to measure.
    max_store_join_pairs: int = 256
    # Register cap of the decode kernel over an FP8 cache at large batches; None: the launch
    # config's (96); 0: none; to measure.
    fp8_decode_maxnreg: Optional[int] = None
    # The rotary of q and k inside the attention kernel (RopeAttentionFusionPass); false keeps it in
    # the graph, to measure. Changes the compiled graph.
    rope_join: bool = True
    # A LoRA adapter's shrink inside its base linear's GEMM (kiln.models.lora's joined layout);
    # false keeps the stacks apart, to measure. Changes the model's weights' layout.
    lora_join: bool = True

    def __post_init__(self) -> None:
        _check_choice("kernels", "pdl", self.pdl, PDL_SETTINGS)
        _check_choice("kernels", "decode_merge", self.decode_merge, DECODE_MERGES)
        for name in ("dense_gemv", "rope_join", "lora_join"):  # a string such as "0" would read as true
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kernels.{name} takes true or false, got {getattr(self, name)!r}")
        if isinstance(self.gemv_join, str):
            raise ValueError(f"kernels.gemv_join takes a list of schemes, e.g. [dense,fp8], got {self.gemv_join!r}")
        object.__setattr__(self, "gemv_join", tuple(self.gemv_join))
        unknown = [s for s in self.gemv_join if s not in GEMV_JOIN_SCHEMES]
        if unknown:
            raise ValueError(f"kernels.gemv_join={list(self.gemv_join)}: {unknown[0]!r} is not a scheme; "
                             f"choose from {list(GEMV_JOIN_SCHEMES)} ([] joins none)")
        if self.max_store_join_pairs < 0:
            raise ValueError(f"kernels.max_store_join_pairs must be >= 0 (0: never joined), "
                             f"got {self.max_store_join_pairs}")
        if self.fp8_decode_maxnreg is not None and self.fp8_decode_maxnreg < 0:
            raise ValueError(f"kernels.fp8_decode_maxnreg must be >= 0 (0: no cap) or null, "
                             f"got {self.fp8_decode_maxnreg}")

    def graph_factors(self) -> dict[str, Any]:
        """The options that change a compiled graph or the weights it runs on: part of the key of
        what is kept beside a compiled forward (``kiln.compiler.artifact_cache.forward_key``)."""
        return {"gemv_join": list(self.gemv_join), "rope_join": self.rope_join, "lora_join": self.lora_join}


@dataclass(frozen=True)
class EngineConfig:
    """Every sub-config, composed (never inherited)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        if self.lora.enabled and self.parallel.pipeline_parallel_size != 1:
            raise ValueError("LoRA adapters are served with parallel.pipeline_parallel_size=1 for now; "
                             "set it to 1 or leave lora off")
        if self.lora.enabled and self.speculative.method == "draft":
            raise ValueError("LoRA adapters and speculative.method=draft do not run together yet")
        if self.speculative.method == "draft" and not self.speculative.draft_model:
            raise ValueError("speculative.method=draft needs speculative.draft_model (a model name, a Hugging "
                             "Face directory or random:<preset> with the target's vocabulary)")
        if self.parallel.data_parallel_size > 1 and self.server.api_server_count != 1:
            raise ValueError(f"parallel.data_parallel_size={self.parallel.data_parallel_size} is served by one "
                             "frontend process for now; set server.api_server_count=1")
        if self.model.quantization not in ("none", "auto") and self.parallel.pipeline_parallel_size != 1:
            raise ValueError(f"model.quantization={self.model.quantization} does not run with "
                             f"parallel.pipeline_parallel_size={self.parallel.pipeline_parallel_size} yet; set "
                             "model.quantization=none or parallel.pipeline_parallel_size=1")
        if self.speculative.enabled and self.parallel.pipeline_parallel_size != 1:
            raise ValueError(f"speculative.method={self.speculative.method} does not run with "
                             f"parallel.pipeline_parallel_size={self.parallel.pipeline_parallel_size} yet (the last "
                             "stage would verify tokens the first has to propose); set speculative.method=none "
                             "or parallel.pipeline_parallel_size=1")
        if self.speculative.enabled and self.parallel.backend != "uni":
            raise ValueError(f"speculative.method={self.speculative.method} runs with parallel.backend=uni "
                             f"for now, not {self.parallel.backend}; set speculative.method=none")

    @classmethod
    def from_kwargs(cls, **groups: Any) -> "EngineConfig":
        """Build from keyword groups, each a dataclass instance or a dict of its fields."""
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        types = {
            "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
            "compile": CompileConfig, "server": ServerConfig, "parallel": ParallelConfig,
            "speculative": SpeculativeConfig, "lora": LoraConfig, "kernels": KernelConfig,
        }
        built = {}
        for name, value in groups.items():
            if name not in kinds:
                raise ValueError(f"unknown config group {name!r}; choose from {sorted(kinds)}")
            if isinstance(value, dict):
                known = {f.name for f in dataclasses.fields(types[name])}
                unknown = set(value) - known
                if name == "compile" and unknown & set(REPLACED_BY_STARTUP):
                    raise ValueError(replaced_by_startup(f"compile.{sorted(unknown & set(REPLACED_BY_STARTUP))[0]}"))
                if unknown:
                    raise ValueError(f"unknown {name} option(s) {sorted(unknown)}; choose from {sorted(known)}")
                if name == "lora":  # LLM(lora={...}) asks for adapters
                    value = {"enabled": True, **value}
                value = types[name](**value)
            elif value is not None and not isinstance(value, types[name]):
                raise TypeError(f"{name} must be a dict or {types[name].__name__}, got {type(value).__name__}")
            if value is not None:
                built[name] = value
        return cls(**built)

    def resolved(self, device_type: str, entrypoint: str = "server") -> "EngineConfig":
        """This config with every ``auto`` / ``None`` default decided for ``device_type`` and the
        ``entrypoint`` ("server" or "offline", the ``LLM`` class)."""
        one_process = self.parallel.backend == "uni"
        lora = dataclasses.replace(self.lora, enabled=True) if self.server.lora_modules else self.lora
        compile, scheduler = resolve_for_device(self.compile, self.scheduler, device_type,
                                                can_background=one_process and self.speculative.method != "draft",
                                                lazy_capture=one_process, entrypoint=entrypoint)
        return dataclasses.replace(self, compile=compile, scheduler=scheduler, lora=lora)


# ---- defaults sized for the device ------------------------------------------------------------------
# Every ``auto`` / ``None`` default of CompileConfig and SchedulerConfig is decided here, and only here;
# the measurements behind each are in docs/decisions/.
# CUDA: kiln's pipeline with full graphs for decode batches and piecewise graphs for mixed ones
# (cuda-graphs-full-and-piecewise.md), and a scheduler wide enough that an offline batch of 512
# requests runs as one decode batch, 4096 tokens a step (cuda-scheduler-limits.md).
# CPU: kiln, built on a thread while the first steps run eagerly, so a start is as fast as eager's
# (cpu-compile-mode.md); a model split over processes (parallel.backend mp or ray) gets eager, since
# its ranks could switch at different steps.
CPU_COMPILE_MODE = "kiln"
# On the CPU kiln's forward is cut at every 10th attention call, the calls between compiled inside the
# pieces: fewer piece calls a step, and Inductor fuses across the layers of a piece; the longer first
# compile is hidden by the background build (cpu-split-every.md). CUDA cuts at every call: piecewise
# graphs capture the pieces between attention calls.
CPU_SPLIT_EVERY = 10
# Where graphs are captured between steps (lazy capture), compile.mode=auto on a cold CUDA start also
# builds kiln's forward in the background: ready once the weights are placed, steps eager until built,
# the KV cache sized after the eager forward and a guess of the graphs' memory
# (MemoryProfiler.profile in kiln/runtime/startup.py; background-build.md, startup-policy.md).
DEVICE_DEFAULTS = {  # device type -> (mode, cudagraph, max_num_seqs, max_num_batched_tokens)
    "cuda": ("kiln", "full_and_piecewise", 512, 4096),
    "cpu": (CPU_COMPILE_MODE, "none", 128, 2048),
}


# Piecewise-only capture sizes above max_num_seqs: every this many tokens up to max_num_batched_tokens.
PIECEWISE_SIZE_STEP = 256


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: Optional[int] = None) -> tuple[int, ...]:
    """CUDA graph sizes for a scheduler of ``max_num_seqs`` (and ``max_num_batched_tokens``): 1, 2, 4,
    then every 8 up to ``max_num_seqs`` (and itself), so a decode batch pads by at most 7 rows; then,
    for the mixed steps of prefill chunks and decodes, which only piecewise graphs take, every
    ``PIECEWISE_SIZE_STEP`` tokens up to ``max_num_batched_tokens`` (and itself). Without those, a
    full step of chunked prefill (larger than any decode batch) runs the compiled pieces without
    graphs, at several times the host time (docs/decisions/cuda-graphs-full-and-piecewise.md)."""
    limit = max_num_seqs if max_num_batched_tokens is None else min(max_num_seqs, max_num_batched_tokens)
    sizes = {s for s in (1, 2, 4) if s <= limit} | set(range(8, limit + 1, 8)) | {limit}
    if max_num_batched_tokens is not None and max_num_batched_tokens > limit:
        step = PIECEWISE_SIZE_STEP
        sizes |= set(range((limit // step + 1) * step, max_num_batched_tokens + 1, step)) | {max_num_batched_tokens}
    return tuple(sorted(sizes))


def default_split_every(device_type: str) -> int:
    """``compile.split_every`` left unset (None), for a model on ``device_type``."""
    return 1 if device_type == "cuda" else CPU_SPLIT_EVERY


ENTRYPOINTS = ("server", "offline")


def resolve_for_device(compile: CompileConfig, scheduler: SchedulerConfig, device_type: str,
                       can_background: bool = True, lazy_capture: bool = True,
                       entrypoint: str = "server") -> tuple[ResolvedCompileConfig, SchedulerConfig]:
    """``compile`` and ``scheduler`` with their ``auto`` / ``None`` fields decided for ``device_type``
    ("cuda" or "cpu") and ``entrypoint`` (ENTRYPOINTS); fields the user set are kept. Idempotent.
    ``can_background``: the model may be built on a thread: it runs in this process as one rank
    (parallel.backend=uni) and is not a speculative draft (two Dynamo captures must not run at once);
    where it cannot, ``compile.mode=auto`` on the CPU is eager. ``lazy_capture``: CUDA graphs may be
    captured between steps (the model runs in the engine's process)."""
    _check_choice("resolve_for_device", "entrypoint", entrypoint, ENTRYPOINTS)
    mode, cudagraph, seqs, tokens = DEVICE_DEFAULTS["cuda" if device_type == "cuda" else "cpu"]
    scheduler = dataclasses.replace(
        scheduler,
        max_num_seqs=scheduler.max_num_seqs if scheduler.max_num_seqs is not None else seqs,
        max_num_batched_tokens=(scheduler.max_num_batched_tokens if scheduler.max_num_batched_tokens is not None
                                else tokens))
    if compile.is_resolved:
        return compile, scheduler
    mode_chosen = compile.mode == "auto"  # a mode named explicitly is built before ready (below)
    if mode_chosen and device_type != "cuda" and not can_background:
        mode = "eager"
    mode = mode if mode_chosen else compile.mode
    if compile.cudagraph == "auto":
        # Piecewise graphs need kiln's split forward: other modes on CUDA get full graphs alone.
        cudagraph = cudagraph if mode == "kiln" or device_type != "cuda" else "full"
    else:
        cudagraph = compile.cudagraph
    split_every = compile.split_every if compile.split_every is not None else default_split_every(device_type)
    capture_sizes = compile.capture_sizes if compile.capture_sizes is not None else default_capture_sizes(
        scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    build, capture = startup_plan(compile.startup, device_type, entrypoint, mode, cudagraph,
                                  can_background and mode == "kiln", lazy_capture, mode_chosen)
    fields = {f.name: getattr(compile, f.name) for f in dataclasses.fields(CompileConfig)}
    fields.update(mode=mode, cudagraph=cudagraph, split_every=split_every, capture_sizes=capture_sizes)
    resolved = ResolvedCompileConfig(**fields, build=build, capture=capture)
    if (resolved.split_every != 1 and resolved.mode == "kiln" and device_type == "cuda"
            and resolved.cudagraph in ("piecewise", "full_and_piecewise")):
        raise ValueError(f"compile.split_every={resolved.split_every} leaves attention calls inside the pieces, "
                         f"which piecewise CUDA graphs cannot capture: set compile.cudagraph=full (or none), "
                         f"or compile.split_every=1")
    return resolved, scheduler


def startup_plan(policy: str, device_type: str, entrypoint: str, mode: str, cudagraph: str,
                 can_background: bool, lazy_capture: bool, mode_chosen: bool = True) -> tuple[str, str]:
    """``compile.startup`` as (build, capture) of a ResolvedCompileConfig. ``can_background``: kiln's
    forward may be built on a thread (kiln mode, one process, no draft); ``lazy_capture``: graphs may
    be captured between steps; ``mode_chosen``: compile.mode was auto (a mode named explicitly is
    built before ready under ``auto``, so a benchmark of modes times each at its own speed)."""
    graphs = device_type == "cuda" and cudagraph != "none"
    # auto offline on CUDA is complete: a batch job's steps use many graph sizes from the first one,
    # and no idle moment comes to capture them (docs/decisions/startup-policy.md).
    if policy == "complete" or (policy == "auto" and entrypoint == "offline" and device_type == "cuda"):
        return "startup", "startup"
    capture = "lazy" if graphs and lazy_capture else "startup"
    if policy == "fast":
        return ("background" if can_background else "startup"), capture
    if not (can_background and mode_chosen):
        return "startup", capture
    return "background_when_cold", capture  # a server: loaded before ready when cached
