"""The CLI's config: ``CliConfig`` (the engine's groups plus the commands' own keys), the Hydra
schema it registers, the checks and rewrites applied to overrides before Hydra sees them, what
``--help`` says about each key, and composition without running a Hydra job. ``kiln.entrypoints.cli``
runs the commands; ``kiln.entrypoints.cache_cmd`` composes with this too.

Rules kept here:
- ``model=X`` is a model, never a YAML file: ``prepare_overrides`` turns it into ``model.model=X``
  (or, when X names a file in ``model_preset/``, into ``model_preset=X``), so a name, a directory,
  a .gguf file and ``random:<preset>`` all reach ``model.model`` as typed.
- A key or group option that does not exist is refused here, naming the closest valid one, before
  Hydra could suggest ``+key=...`` (which would add a key nothing reads).
- ``FIELD_HELP`` and ``CHOICES`` cover every field of ``CliConfig``; tests/entrypoints/test_cli.py checks both
  against the dataclasses, so they cannot drift from kiln/config.py.
- A secret never reaches Hydra: ``extract_secrets`` swaps ``server.api_key=VALUE`` for
  ``server.api_key='***'`` and hands VALUE back for the environment ($KILN_API_KEY), so what Hydra
  saves (.hydra/*.yaml), prints (--cfg job) or names a sweep's jobs after holds only ``***``.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from kiln.bench.sweep import BENCH_KINDS, BenchConfig
from kiln.config import (
    API_KEY_ENV, COMPILE_MODES, CUDAGRAPH_MODES, DECODE_MERGES, PDL_SETTINGS, REDACTED, CacheConfig, CompileConfig,
    EngineConfig, KernelConfig, LoraConfig, ModelConfig, QUANTIZATIONS, REPLACED_BY_STARTUP, ParallelConfig,
    SchedulerConfig, ServerConfig, SPECULATIVE_METHODS, STARTUP_POLICIES, TOOL_CALL_PARSERS, SpeculativeConfig,
    replaced_by_startup,
)

# The Hydra YAML is package data (kiln/configs/), so a wheel install finds it as a checkout does.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
SCHEMA_NAME = "kiln_schema"
PRESET_GROUP = "model_preset"  # YAML files that set several model.* fields (`# @package model`)


@dataclass(frozen=True)
class CliConfig:
    """The composed config of every subcommand: the engine's groups plus the commands' own keys."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kernels: KernelConfig = field(default_factory=KernelConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    prompt: str = "Give me three tips for a good night's sleep."  # generate
    max_tokens: int = 64  # generate
    temperature: float = 0.0  # generate; 0 is greedy
    chat: bool = True  # generate: apply the chat template when the tokenizer has one


# What `kiln <command> --help` says about each key (from the dataclasses' docstrings and comments).
FIELD_HELP = {
    "model.model": "a registered name (smollm2-135m-instruct), a Hugging Face directory, a .gguf file, "
                   "or random:<preset> (random:tiny, random:llama3-8b, ...)",
    "model.dtype": "weights and activations; auto: float32 on CPU, bfloat16 on GPU",
    "model.device": "auto: cuda when available, else cpu",
    "model.max_model_len": "longest prompt plus output in tokens; null: the model's own context length",
    "model.seed": "seed of random weights and of unseeded sampling",
    "model.impl": "auto: kiln's own model code when it has the family (see docs/models.md), else the "
                  "generic path (transformers' modeling code, captured and given kiln's paged attention); "
                  "native or transformers: force one",
    "model.quantization": "linear weights: auto (the checkpoint's own: a Q4 GGUF as int4), none, int8 / int4 (weight-only), fp8 (SM89+ GPUs)",
    "model.int4_group_size": "input columns per scale and zero of int4 weights quantized at load (checkpoints with "
                             "their own groups keep theirs); larger groups read fewer bytes and round more",
    "cache.block_size": "tokens per KV cache block",
    "cache.enable_prefix_caching": "reuse the KV blocks of a prompt prefix computed before",
    "cache.kv_cache_memory_gib": "KV cache budget; null: 1 GiB on CPU, from gpu_memory_fraction on GPU",
    "cache.gpu_memory_fraction": "share of the GPU's memory kiln may fill; the KV cache gets what is left",
    "cache.num_blocks": "exact number of KV blocks, overriding the memory budget; null: from the budget",
    "cache.dir": "converted models and compiled artifacts; null: $KILN_CACHE_DIR or ~/.cache/kiln",
    "cache.dtype": "KV cache element type; auto: the model dtype, fp8: float8_e4m3fn (2x bf16's tokens) "
                   "with per-layer k/v scales (the checkpoint's k_scale/v_scale, else 1)",
    "cache.calculate_kv_scales": "fp8 cache: set the k/v scales from the first prefill's amax, then keep them",
    "scheduler.max_num_seqs": "most requests in one step; null: 512 on GPU, 128 on CPU",
    "scheduler.max_num_batched_tokens": "most tokens in one step (decodes and prefill chunks); null: 4096 on GPU, 2048 on CPU",
    "scheduler.enable_chunked_prefill": "split a long prompt over several steps",
    "scheduler.policy": "fcfs: by arrival; priority: lower priority value first, then by arrival",
    "compile.mode": "auto: kiln (a server loads it before ready when cached, else builds it in the background, as does LLM on "
                    "the CPU; eager on the CPU with parallel.backend mp/ray); "
                    "eager: op by op; stock: plain torch.compile; kiln: kiln's passes, split at attention, "
                    "Inductor per piece",
    "compile.cudagraph": "CUDA graphs (GPU): full for decode-only batches, piecewise between attention "
                         "ops (mode kiln), or both; auto: full_and_piecewise on GPU (full for other modes)",
    "compile.sizes": "extra batch sizes (tokens) Inductor specializes for",
    "compile.capture_sizes": "batch sizes (tokens) captured as CUDA graphs; a batch is padded up to one; "
                             "null: 1, 2, 4, then every 8 up to scheduler.max_num_seqs, then every 256 up to "
                             "scheduler.max_num_batched_tokens (piecewise graphs only)",
    "compile.startup": "what is built before ready. complete: the compiled forward and every CUDA graph; "
                       "fast: ready once the weights are placed, the forward built on a thread while steps "
                       "run eagerly, graphs captured between steps; auto: the forward before ready when "
                       "the compile cache holds it (else fast's thread), the smallest graphs before ready "
                       "and the rest between steps",
    "compile.split_every": "mode kiln: cut the graph at every Nth attention call, the others compiled inside "
                           "the pieces (0: one piece); fewer, larger pieces run faster and compile slower; "
                           "null: 10 on the CPU, 1 on a GPU (other values need compile.cudagraph=full or none)",
    "compile.build_gate": "GPU: a build on a thread waits while a step runs, so steps beside it keep their "
                          "speed (false: to measure the build without it)",
    "compile.debug_dump_dir": "write the bytecode and the graphs before and after each pass here; null: off",
    "server.host": "address to listen on; 0.0.0.0: every interface",
    "server.port": "TCP port",
    "server.api_key": "the Bearer token every /v1 route wants; null: server.api_key_file, else $KILN_API_KEY, "
                      "else no auth. Given here it moves to $KILN_API_KEY; saved configs show ***",
    "server.api_key_file": "a file whose first line is the API key (instead of server.api_key)",
    "server.allowed_hosts": "Host headers served, e.g. [localhost,127.0.0.1,*.example.com]; [\"*\"]: any host",
    "server.served_model_name": "the model name the API reports; null: the loaded model's name",
    "server.lora_modules": "LoRA adapters served from the start, [name=path,...] (PEFT directories); a request "
                           "picks one with \"model\": name (turns lora.enabled on)",
    "server.cors_origins": "origins allowed by CORS; empty: no CORS",
    "server.max_request_bytes": "larger request bodies get HTTP 413",
    "server.max_prompts_per_request": "most prompts in one completion request; more: HTTP 400",
    "server.max_seqs_per_request": "most sequences (prompts x n) one request may start; more: HTTP 400",
    "server.tool_call_parser": "how the model writes tool calls: auto (by its chat template), hermes, llama3_json, "
                               "mistral, qwen3_coder, pythonic or deepseek_v3",
    "server.reasoning_parser": "split a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3, "
                               "deepseek_v3, minimax_m2, glm45, mistral or seed_oss; null: off",
    "server.structured_outputs_in_reasoning": "with a reasoning parser, grammars constrain the thinking too "
                                              "(default: they start after it)",
    "server.max_queued_seqs": "most sequences admitted and unfinished, server-wide; more: HTTP 429",
    "server.max_queued_tokens": "most prompt tokens (each of n counts) admitted and unfinished; more: HTTP 429",
    "server.header_read_timeout_s": "a request's headers must arrive within this, else the connection closes",
    "server.body_read_timeout_s": "a request's body must arrive within this of its start, else HTTP 408",
    "server.keep_alive_timeout_s": "an idle keep-alive connection closes after this",
    "server.allowed_media_domains": "hosts whose http(s) image URLs chat requests may name, e.g. [images.example.com]; "
                                    "empty: data URLs only",
    "server.allowed_local_media_path": "a directory whose file:// image URLs chat requests may name; null: none",
    "server.media_fetch_timeout_s": "an image URL must be fetched within this, else HTTP 400",
    "server.max_media_bytes": "larger fetched or inline images get HTTP 400",
    "server.max_image_pixels": "images of more pixels (width x height, decompression bombs too) get HTTP 400",
    "server.limit_mm_per_prompt": "most images in one request; more: HTTP 400",
    "server.api_server_count": "frontend processes (HTTP, tokenizing, detokenizing) on the one port in front of "
                               "one engine core; the queue limits are split between them, /metrics adds up",
    "parallel.tensor_parallel_size": "devices the model is split over (tensor parallelism)",
    "parallel.pipeline_parallel_size": "stages the layers are split over, one process each (pipeline parallelism; "
                                       "parallel.backend mp or ray); ranks: tensor x pipeline",
    "parallel.backend": "uni: one process; mp: one process per rank; ray: one Ray actor per rank",
    "parallel.step_timeout_s": "a rank silent this long in one step fails the engine",
    "parallel.all_reduce": "symm_mem: small all-reduces through PyTorch symmetric memory (CUDA, one host), NCCL above",
    "parallel.placement_strategy": "ray: how the ranks are laid over nodes; PACK fills a node first",
    "parallel.enable_expert_parallel": "mixture-of-experts models: place the experts whole across the tensor-parallel "
                                       "ranks instead of cutting each one (needs tensor_parallel_size > 1)",
    "parallel.data_parallel_size": "engine cores (replicas: a process, KV cache and GPU each) behind one server, "
                                   "requests balanced by load and prefix-cache affinity; serving only",
    "speculative.method": "none; ngram: propose what followed the context's last n-gram earlier in it; "
                          "draft: a smaller model with the same vocabulary proposes",
    "speculative.num_speculative_tokens": "k: tokens proposed per request and step, all checked in one forward",
    "speculative.prompt_lookup_min": "ngram: the shortest suffix looked up in the context",
    "speculative.prompt_lookup_max": "ngram: the longest suffix looked up (the longest match wins)",
    "speculative.draft_model": "draft: the proposing model (a name, a Hugging Face directory or random:<preset>)",
    "speculative.draft_dtype": "draft: its dtype; auto: as the target model",
    "speculative.draft_compile_mode": "draft: compile.mode of the draft model",
    "speculative.draft_cudagraph": "draft: compile.cudagraph of the draft model",
    "speculative.max_batch_size": "speculate only while at most this many requests decode in one step",
    "lora.enabled": "serve PEFT LoRA adapters beside the base model (server.lora_modules turns it on; "
                    "/v1/load_lora_adapter adds more at run time)",
    "lora.max_loras": "adapters on the device at once: distinct adapters one step may mix with the base model",
    "lora.max_lora_rank": "the largest adapter rank r served; the device slots' size",
    "lora.max_cpu_loras": "adapters kept loaded on the host (least recently used dropped first); null: max_loras",
    "kernels.pdl": "programmatic dependent launch of kiln's Triton kernels (SM90+ GPUs): on; off; gemm: the "
                   "weight-only GEMVs only (to measure each part)",
    "kernels.gemv_join": "schemes whose one-row GEMV computes its input from the add + RMSNorm or SiLU-and-mul "
                         "feeding it, of dense, fp8, int4 ([] none, to measure; fp8 and int4 measured no faster)",
    "kernels.dense_gemv": "bf16/fp16 linears at one row through kiln's Triton GEMV; false: cuBLAS (to measure)",
    "kernels.decode_merge": "split-K decode attention: fused (the last split merges the others) or kernel "
                            "(a merge launch of its own, to measure)",
    "kernels.max_store_join_pairs": "the decode kernel stores the new K/V itself up to this many (decode, kv head) "
                                    "pairs, larger batches in launches of their own; 0: never (to measure)",
    "kernels.fp8_decode_maxnreg": "register cap of the FP8-cache decode kernel at large batches; null: 96, "
                                  "0: none (to measure)",
    "kernels.rope_join": "rotate q and k inside the attention kernel (GPU); false: the rotary stays in the graph "
                         "(to measure)",
    "kernels.lora_join": "LoRA's shrink inside its base linear's GEMM (GPU); false: the stacks apart (to measure)",
    "bench.kind": "throughput, latency, serve (over HTTP) or startup",
    "bench.batch_sizes": "concurrent requests per measured point",
    "bench.prompt_len": "tokens per prompt (random ids, fixed length)",
    "bench.output_len": "tokens per output (ignore_eos, so every request runs this long)",
    "bench.num_requests": "throughput/serve: at least this many requests per batch size",
    "bench.num_iters": "latency: timed requests; startup: fresh processes",
    "bench.seed": "seed of the prompts' token ids",
    "bench.timeout_s": "limit of one worker process, start-up included",
    "prompt": "the prompt to complete",
    "max_tokens": "most tokens to generate",
    "temperature": "sampling temperature; 0 is greedy",
    "chat": "apply the model's chat template when it has one; false: plain completion",
}

# The values each field allows, as its dataclass checks them (test_cli checks they agree).
CHOICES: dict[str, tuple] = {
    "model.dtype": ("auto", "float32", "bfloat16", "float16"),
    "model.device": ("auto", "cpu", "cuda"),
    "model.impl": ("auto", "native", "transformers"),
    "model.quantization": QUANTIZATIONS,
    "cache.dtype": ("auto", "fp8"),
    "scheduler.policy": ("fcfs", "priority"),
    "compile.mode": COMPILE_MODES,
    "compile.cudagraph": CUDAGRAPH_MODES,
    "compile.startup": STARTUP_POLICIES,
    "parallel.backend": ("uni", "mp", "ray"),
    "parallel.all_reduce": ("nccl", "symm_mem"),
    "parallel.placement_strategy": ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"),
    "speculative.method": SPECULATIVE_METHODS,
    "speculative.draft_dtype": ("auto", "float32", "bfloat16", "float16"),
    "speculative.draft_compile_mode": COMPILE_MODES,
    "speculative.draft_cudagraph": CUDAGRAPH_MODES,
    "bench.kind": BENCH_KINDS,
    "server.tool_call_parser": TOOL_CALL_PARSERS,
    "kernels.pdl": PDL_SETTINGS,
    "kernels.decode_merge": DECODE_MERGES,
}


def config_keys() -> dict[str, list[str]]:
    """Every key of ``CliConfig`` by section: a sub-config's name, or "" for the top-level keys."""
    hints = typing.get_type_hints(CliConfig)
    sections: dict[str, list[str]] = {}
    for f in dataclasses.fields(CliConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            sections[f.name] = [f"{f.name}.{sub.name}" for sub in dataclasses.fields(hints[f.name])]
        else:
            sections.setdefault("", []).append(f.name)
    return sections


def group_options(group: str) -> list[str]:
    """The YAML options of a config group (kiln/configs/<group>/*.yaml); none for a plain section."""
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def prepare_overrides(overrides: list[str]) -> list[str]:
    """``overrides`` with ``model=X`` rewritten. An unknown key or group option is a ValueError that
    names the closest valid one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        bad = next((o for o in overrides if "=[" in o and "=" in o.split("=[", 1)[1] and '"' not in o), None)
        if bad is None:
            raise
        key, items = bad.split("=[", 1)
        quoted = ",".join(f'"{item}"' for item in items.rstrip("]").split(","))
        raise ValueError(f"{bad}: quote each item of a list that holds '=', e.g. '{key}=[{quoted}]' "
                         "(in single quotes for the shell)") from e
    prepared = []
    for override in parsed:
        if override.is_hydra_override() or override.package is not None:
            prepared.append(override.input_line)  # Hydra's own settings: Hydra's to check
        elif override.key_or_group == "model" and not override.is_delete():
            prepared.append(_model_override(override))
        else:
            _check_key(override)
            prepared.append(override.input_line)
    return prepared


# Keys whose value is a secret, and the environment variable that carries it instead.
SECRET_KEYS = {"server.api_key": API_KEY_ENV}


def extract_secrets(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """``overrides`` with each secret's value replaced by REDACTED, and the environment variables
    that carry the values instead (for the caller to set). A sweep over a secret is refused."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType

    kept, env = [], {}
    parsed = OverridesParser.create().parse_overrides(overrides)
    for override in parsed:
        key = override.key_or_group
        if key not in SECRET_KEYS or override.is_delete() or override.value() is None:
            kept.append(override.input_line)
            continue
        if override.value_type != ValueType.ELEMENT:
            raise ValueError(f"{key} takes one value, not a sweep")
        env[SECRET_KEYS[key]] = str(override.value())
        prefix = override.input_line[:len(override.input_line) - len(override.input_line.lstrip("+"))]
        kept.append(f"{prefix}{key}='{REDACTED}'")
    if env and any(o.key_or_group == "server.api_key_file" and not o.is_delete() and o.value() is not None
                   for o in parsed):
        raise ValueError("give server.api_key or server.api_key_file, not both")
    return kept, env


def _model_override(override) -> str:
    """``model=X``: ``model_preset=X`` when X names a preset file, else ``model.model=X``."""
    names = _element_values(override)
    presets = [n for n in names if n in group_options(PRESET_GROUP)]
    if presets and len(presets) != len(names):
        raise ValueError(f"{override.input_line} mixes presets and models; "
                         f"sweep {PRESET_GROUP}=... or model.model=... instead")
    value = override.input_line.split("=", 1)[1]
    return f"{PRESET_GROUP}={value}" if presets else f"model.model={value}"


def _check_key(override) -> None:
    key = override.key_or_group
    if (CONFIG_DIR / key).is_dir():
        options = group_options(key)
        for name in _element_values(override):
            if name not in options:
                raise ValueError(f"unknown {key} option {name}; "
                                 + _did_you_mean(name, options, f"choose one of {', '.join(options)}"))
        return
    if key in {f"compile.{name}" for name in REPLACED_BY_STARTUP}:
        raise ValueError(replaced_by_startup(key))
    sections = config_keys()
    known = [k for keys in sections.values() for k in keys]
    if key in known:
        _check_value(key, override)
        return
    if key in sections or any(key.startswith(k + ".") for k in known):
        return  # a whole sub-config, or an element of a list-valued key
    groups = [g.name for g in CONFIG_DIR.iterdir() if g.is_dir()]
    raise ValueError(f"unknown key {key}; "
                     + _did_you_mean(key, known + groups + ["model"], "`kiln <command> --help` lists every key"))


# What a scalar field takes, in the words of the error a wrong value gets.
_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}


def _field_type(key: str):
    """The type hint of ``key`` (``section.name`` or a top-level name) in CliConfig."""
    owner, _, name = key.rpartition(".")
    cls = typing.get_type_hints(CliConfig)[owner] if owner else CliConfig
    return typing.get_type_hints(cls)[name]


def _check_value(key: str, override) -> None:
    """A value of the wrong type for a scalar key is a ValueError in kiln's words (Hydra's own
    message would name OmegaConf's conversion and HYDRA_FULL_ERROR)."""
    from hydra.core.override_parser.types import ValueType

    if override.is_delete() or override.value_type != ValueType.ELEMENT:
        return  # a sweep's values are checked per job, when to_object builds the config
    hint = _field_type(key)
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        hint = next((a for a in args if a is not type(None)), hint)
    if hint not in _KINDS:
        return  # tuples, dicts: Hydra's and the dataclass's to check
    value = override.value()
    if value is None:
        ok = optional
    elif hint is bool:
        ok = isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = not isinstance(value, (list, dict))
    if not ok:
        raise ValueError(f"{key} takes {_KINDS[hint]}{' or null' if optional else ''}, got "
                         f"{override.input_line.split('=', 1)[1]!r}")


def _element_values(override) -> list[str]:
    """The names an override sets: one, or each of a choice sweep (``a,b,c``, ``choice(a,b)``)."""
    from hydra.core.override_parser.types import ValueType

    if override.value_type == ValueType.ELEMENT:
        values = [override.value()]
    elif override.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP):
        values = list(override.sweep_string_iterator())
    else:
        values = []  # a deletion, a range or a glob: Hydra's to check
    return [v for v in values if isinstance(v, str)]


def _did_you_mean(name: str, candidates: list[str], otherwise: str) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f"did you mean {close[0]}?" if close else otherwise


def engine_config(cli: CliConfig) -> EngineConfig:
    return EngineConfig(model=cli.model, cache=cli.cache, scheduler=cli.scheduler,
                        compile=cli.compile, server=cli.server, parallel=cli.parallel,
                        speculative=cli.speculative, lora=cli.lora, kernels=cli.kernels)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore; call before composing (main and tests do)."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NAME, node=_writable(OmegaConf.structured(CliConfig)))


def _writable(node):
    # OmegaConf marks the node of a frozen dataclass read-only, which would refuse every override.
    # The YAML and overrides are merged into a writable copy; to_object then builds the frozen objects.
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_readonly(node, False)
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
    return node


def compose_config(overrides: list[str]) -> CliConfig:
    """Compose without running a Hydra job (no output dir, no logging set-up): ``kiln cache``, help, tests."""
    from hydra import compose, initialize_config_dir

    overrides = prepare_overrides(overrides)
    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return to_cli_config(compose(config_name="config", overrides=overrides))


def to_cli_config(cfg) -> CliConfig:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def fail(message: str, code: int = 2) -> NoReturn:
    print(f"kiln: error: {message}", file=sys.stderr)
    sys.exit(code)
