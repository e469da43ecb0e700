"""ModelRunner: owns the model, its KV cache tensors and the sampler on one device.

One step is ``launch(SchedulerOutput) -> LaunchedStep`` then ``collect(LaunchedStep) -> RunnerOutput``
(``execute`` does both): launch enqueues the device work, collect waits for the sampled tokens, so
on a GPU the engine can process the previous step's outputs in between. It never decides what runs
(the scheduler's job) and never touches graphs or kernels (the ``CompiledModel``'s): a step is
``InputBatch.prepare`` (the step written into the compiled model's persistent buffers), then
``CompiledModel.run`` (graph dispatch, padding, forward context), then logits for the rows that
sample, then the sampler.

Start-up is a list of phases (``__init__``): choose the device and its ``KernelSet``; load the
weights; build the ``CompiledModel`` (compile, or load compiled artifacts); on CUDA profile the
largest step's activations; size and allocate the KV cache (``kiln.runtime.kv_sizing``); capture
CUDA graphs over it; make the sampler. With a background build (``compile.startup``) the build starts last, once
all of that is done (on CUDA after a warm-up of the eager forward), except on a first CUDA start (no
memory profile kept), where it starts as the weights start loading; graphs are captured between steps
once it ends. ``kiln.runtime.startup`` owns the phases' names and timing (each phase's time lands in
``startup_seconds``), the eager warm-up and the memory profile the KV cache is sized after.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch

from kiln.compiler import ArtifactCache, CompiledModel, InputLimits, VerifyShape, forward_profile_key
from kiln.compiler.artifact_cache import use_kernel_caches
from kiln.compiler.saved_forward import prefetch_source_keys, prefetch_triton_key
from kiln.config import (CacheConfig, CompileConfig, LoraConfig, ModelConfig, SchedulerConfig,
                         SpeculativeConfig, resolve_for_device)
from kiln.models.loader import LoadedModel, kv_cache_dtype, load_model, resolve_device, resolve_dtype
from kiln.models.parallel import SINGLE, TensorParallel, local_num_kv_heads, min_over_ranks
from kiln.models.pipeline import WHOLE, PipelineStage
from kiln.ops.registry import select_kernels
from kiln.runtime import kv_sizing
from kiln.runtime.draft_proposer import DraftProposer, DraftTarget
from kiln.runtime.encoder_cache import EncoderCache
from kiln.runtime.input_batch import InputBatch
from kiln.runtime.kv_sizing import KVShape
from kiln.runtime.lora_manager import LoraManager
from kiln.runtime.ngram_proposer import NgramProposer
from kiln.runtime.pipeline import StageLink
from kiln.runtime.rejection_sampler import VerifiedTokens, verify
from kiln.runtime.request import Request
from kiln.runtime.sampler import SampledTokens, Sampler, host_to_device
from kiln.runtime.structured_output import GrammarBitmasks, GrammarCompiler
from kiln.runtime.scheduler_output import SchedulerOutput
from kiln.runtime.startup import MemoryProfiler, StartupClock, log_startup, warm_up

logger = logging.getLogger(__name__)

# (prompt position, {token id: logprob}) for the prompt's own token there and the top-N
PromptLogprobs = list[tuple[int, dict[int, float]]]


@dataclass
class RunnerOutput:
    # One token per request, or (a step that verified proposed tokens) a list: the kept proposed
    # tokens, then one more; logprobs then hold one entry per token.
    sampled_token_ids: dict[str, int | list[int]] = field(default_factory=dict)
    logprobs: dict[str, Optional[dict[int, float]] | Optional[list[dict[int, float]]]] = field(default_factory=dict)
    # Speculative decoding, per request that had proposed tokens: (proposed, kept).
    spec_counts: dict[str, tuple[int, int]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)  # requests that asked only
    embeddings: dict[str, list[float]] = field(default_factory=dict)  # embedding requests that finished


@dataclass
class LaunchedStep:
    """A step whose device work is enqueued; ``ModelRunner.collect`` turns it into a RunnerOutput."""

    request_ids: list[str] = field(default_factory=list)  # one per sampled request, in row order
    samples: Optional[SampledTokens] = None  # None: nothing sampled here (no row, or rank > 0)
    verified: Optional[VerifiedTokens] = None  # instead of samples, when proposed tokens were verified
    num_proposed: list[int] = field(default_factory=list)  # per verified request: proposed tokens, fillers not counted
    constrained: Optional[ConstrainedStep] = None  # instead of samples, when a grammar constrains a row
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class ConstrainedStep:
    """A step a grammar constrains: sampled in ``collect``, once the bitmask filled meanwhile is ready."""

    logits: torch.Tensor  # [num_sampled, vocab]
    requests: list[Request]
    greedy_ids: Optional[torch.Tensor]
    bitmask: Future  # of GrammarBitmasks.fill(requests)

    def sample(self, sampler: Sampler) -> SampledTokens:
        return sampler.launch(self.logits, self.requests, self.greedy_ids, self.bitmask.result())


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, compile_config: CompileConfig,
                 scheduler_config: Optional[SchedulerConfig] = None, tp: TensorParallel = SINGLE,
                 speculative: SpeculativeConfig = SpeculativeConfig(), lora: LoraConfig = LoraConfig(),
                 stage: PipelineStage = WHOLE):
        self.stage = stage  # under pipeline parallelism: this rank's layers; the last stage samples
        try:
            self._start(model_config, cache_config, compile_config, scheduler_config, tp, speculative, lora)
        except BaseException:
            # A first CUDA start's build began with the weight read: stop both rather than leave
            # their threads holding the model, GPU memory and the one-build lock (an LLM(...)
            # retried in this process).
            if getattr(self, "loaded", None) is not None:
                self.loaded.cancel_fill()
            if getattr(self, "compiled", None) is not None:
                self.compiled.cancel_build()
            raise

    def _start(self, model_config: ModelConfig, cache_config: CacheConfig, compile_config: CompileConfig,
               scheduler_config: Optional[SchedulerConfig], tp: TensorParallel, speculative: SpeculativeConfig,
               lora: LoraConfig = LoraConfig()):
        clock = StartupClock()  # every phase's time, in kiln.runtime.startup's one table
        self.tp = tp  # under tensor parallelism: this rank's shard; rank 0 alone samples
        self.is_sampler = tp.rank == 0 and self.stage.is_last  # the rank that samples and answers
        self.device = resolve_device(model_config.device)
        self.dtype = resolve_dtype(model_config.dtype, self.device)
        self.block_size = cache_config.block_size
        self.kernels = select_kernels(self.device.type)
        # The engine resolved these already; a runner built on its own resolves its `auto`s the same way.
        compile_config, scheduler_config = resolve_for_device(compile_config, scheduler_config or SchedulerConfig(),
                                                              self.device.type)
        if not self.stage.is_last:  # a full graph ends in the logits, which only the last stage has
            compile_config = dataclasses.replace(compile_config, cudagraph=_WITHOUT_FULL[compile_config.cudagraph])
        if self.device.type == "cuda":  # before anything JIT-compiles: kernels land in kiln's cache dir
            use_kernel_caches(cache_config.resolved_dir)
            prefetch_triton_key()  # what the first launch of a Triton kernel hashes, while the weights load
            if compile_config.mode == "kiln" and compile_config.build == "startup":  # (a build's thread does)
                prefetch_source_keys()  # what loading compiled pieces hashes, while the weights load
        with clock.phase("load_call_s"):
            # A checkpoint's weights may still be read while the model compiles (a cold start).
            self.loaded: LoadedModel = load_model(model_config, cache_config.resolved_dir, self.device, self.dtype,
                                                 tp, self.kernels, background=True, stage=self.stage)
        clock.add("load_weights_s", clock.get("load_call_s"))
        self.model, self.arch = self.loaded.model, self.loaded.arch
        # Multi-LoRA: the adapter slots are part of the model (and of its compiled graph) from here.
        if lora.enabled:  # on CUDA the slots move the targeted linears' weights: read them in first
            clock.add("load_weights_s", self.loaded.wait_for_weights())
        self.lora = LoraManager(self.model, lora, self.dtype, self.device) if lora.enabled else None
        self.max_model_len = self.loaded.max_model_len
        sched = scheduler_config
        self.layer_ids = self.stage.layers(self.arch.num_layers)  # the layers (and KV caches) of this stage
        self.kv_shape = KVShape(len(self.layer_ids), self.block_size, local_num_kv_heads(self.arch, tp),
                                self.arch.head_dim, kv_cache_dtype(cache_config.dtype, self.dtype, self.device))
        artifacts = ArtifactCache(cache_config.resolved_dir, self._artifact_name())
        # The memory profile is kept on CUDA only: hashing the model and kiln's source for its key took
        # 0.3-0.4 s of a CPU start in a stack sample, and a restart of SmolLM2 was ready 0.17 s sooner
        # without it (benchmarks/results/startup-cpu.json#startup_cpu_ab-profile-key-amd-epyc); the
        # build's thread, off the start's path, has its own.
        self._profile_key = (forward_profile_key(self.model, compile_config, self.kernels, artifacts)
                             if self.device.type == "cuda" or compile_config.build == "background_when_cold" else None)
        self._profile_artifacts = artifacts
        self._verify = verify_shape(speculative, sched) if speculative.enabled else None
        self._has_draft = speculative.method == "draft"
        want_graphs = cache_config.num_blocks is None and cache_config.kv_cache_memory_gib is None
        self.memory_profiler = MemoryProfiler(self._memory_profile_cache(sched, want_graphs) if self.device.type == "cuda"
                                     else None, self.kv_shape, self.device, self.max_model_len, sched, want_graphs)
        if compile_config.build == "background_when_cold":
            # compile.startup=auto: this forward was built here before, so the compile cache holds it
            # and loading it before ready costs about a second; else it compiles on a thread.
            warm = artifacts.has_forward(self._profile_key)
            compile_config = dataclasses.replace(compile_config, build="startup" if warm else "background")
            if compile_config.mode == "kiln" and compile_config.build == "startup":
                prefetch_source_keys()
        self.compile_config = compile_config
        limits = InputLimits(sched.max_num_batched_tokens, sched.max_num_seqs, -(-self.max_model_len // self.block_size),
                             lora_slots=self.lora is not None)
        # A later stage's input rows, received from the stage before (before the compile: graphs read them).
        stage_input = None if self.stage.is_first else self.model.bind_stage_input(limits.max_num_tokens)
        self.link = StageLink(tp, self.stage, stage_input) if self.stage.size > 1 else None
        self.compiled = CompiledModel(self.model, compile_config, self.kernels, limits, self.max_model_len, artifacts,
                                      forward_key=self._profile_key)
        if self.device.type == "cuda" and self.memory_profiler.kept is None:
            # a background build on a first start: the build compiles for tens of seconds, so it
            # starts beside the weight read. A warm start's build loads from the compile cache in seconds
            # of Python that would slow the read and the warm-up more than that gains: after ready.
            self.compiled.start_build()
        in_background = self.loaded.filling is not None
        # The eager warm-up before a background build (the first launch of each kernel) reads no
        # weight's value: while they still land, it runs over a scratch cache of its own (the real
        # one is sized once the read's memory is free again).
        warmed_early = in_background and self.compiled.building and self.device.type == "cuda"
        if warmed_early:
            with clock.phase("eager_warm_up_s"):
                warm_up(self.compiled, self.kv_shape, self.device, scratch=True)
        with clock.phase("weights_wait_s"):
            clock.add("load_weights_s", self.loaded.wait_for_weights())
        if warmed_early:
            torch.cuda.empty_cache()  # the scratch cache: the KV cache is sized after what is in use
        self.input_batch = InputBatch(self.compiled.inputs, self.block_size)
        self.proposer = self._make_proposer(speculative, model_config, cache_config, sched)
        if speculative.enabled:
            self.compiled.set_verify_shape(self._verify)
        _check_verify_capture_sizes(speculative, sched, compile_config)
        activation_bytes, self.graph_estimate = 0, None
        with clock.phase("profile_s"):
            if self.device.type == "cuda":
                draft = self.proposer if isinstance(self.proposer, DraftProposer) else None
                activation_bytes, self.graph_estimate = self.memory_profiler.profile(
                    self.compiled, draft, self.arch.num_layers + 1, self.arch.hidden_size * self.dtype.itemsize)
        with clock.phase("kv_alloc_s"):
            self.num_blocks, self.kv_caches = self._make_kv_caches(cache_config, activation_bytes)
            first = self.layer_ids.start  # the checkpoint's scales by global layer, the cache's by this stage's
            stage_scales = {i - first: v for i, v in self.loaded.kv_scales.items() if i in self.layer_ids}
            self.kv_scales = kv_sizing.allocate_kv_scales(self.kv_shape, stage_scales, self.device)
        self.compiled.bind_kv_caches(self.kv_caches, self.kv_scales,
                                     calibrate_kv_scales=cache_config.calculate_kv_scales)
        # lazy capture: the smallest sizes now (the first requests' decodes), the rest between
        # steps (capture_pending); the KV cache was sized after the memory of every size all the same.
        self.lazy_capture = compile_config.capture == "lazy" and self.device.type == "cuda"
        startup_max_size = compile_config.startup_capture_max if self.lazy_capture else None
        try:
            self.compiled.capture_graphs(max_size=startup_max_size)
        except torch.OutOfMemoryError as e:
            raise ValueError(f"CUDA graph capture ran out of GPU memory ({e}); drop the largest "
                             "compile.capture_sizes (or lower scheduler.max_num_seqs), or lower "
                             "cache.gpu_memory_fraction / cache.kv_cache_memory_gib to leave room") from e
        if self.graph_estimate is not None:
            logger.info("CUDA graphs: %.2f GiB used, %.2f GiB was kept for them%s",
                        self.compiled.graph_memory_bytes / 2**30, self.graph_estimate.bytes() / 2**30,
                        "; every size is captured between steps once kiln's forward is built" if self.compiled.building
                        else f"; {self.compiled.num_pending_captures} sizes are captured between steps"
                        if self.has_pending_captures else "")
        self._lazy_capture_seconds = 0.0
        if isinstance(self.proposer, DraftProposer):
            self.proposer.bind_kv_caches(self.draft_kv_caches)
        self.sampler = Sampler(seed=model_config.seed)
        # A vision-language model: image embeddings by content hash, computed as steps ask.
        self.encoder_cache = EncoderCache(self.model, self.device) if hasattr(self.model, "encode_images") else None
        # Pinned buffers the sampled ids are read back through on a GPU (_start_read_back).
        self._read_back: list[Optional[torch.Tensor]] = [None, None]
        self._read_back_done = [torch.cuda.Event(), torch.cuda.Event()] if self.device.type == "cuda" else []
        self._read_back_turn = 0
        if self.compiled.building and self.device.type == "cuda" and not warmed_early:  # else the first step pays
            with clock.phase("eager_warm_up_s"):  # before the tokenizer wait: its thread goes on meanwhile
                warm_up(self.compiled, self.kv_shape, self.device)
        with clock.phase("tokenizer_wait_s"):
            self.tokenizer = self.loaded.wait_for_tokenizer()  # built on a thread meanwhile (a checkpoint's)
        self.grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size, _stop_ids(self.arch.eos_token_id))
        on_gpu = self.device.type == "cuda"
        self.bitmasks = GrammarBitmasks(self.grammars, pin_memory=on_gpu, background=on_gpu)
        self._pool_sums: dict[str, tuple[torch.Tensor, int]] = {}  # mean pooling across prefill chunks
        num_usable = self.num_blocks - 1  # block 0 is the pool's null block (kiln.runtime.block_pool)
        logger.info("KV cache: %d usable blocks of %d tokens (%d tokens of context; 1 more block is reserved) "
                    "in %.2f GiB; CUDA graphs %.2f GiB", num_usable, self.block_size, num_usable * self.block_size,
                    self.num_blocks * self.kv_shape.bytes_per_block / 2**30,
                    self.compiled.graph_memory_bytes / 2**30)
        self.startup_seconds = clock.finish(self.compiled.startup_seconds())
        self.compiled.start_build()  # a warm start's build (a first start's began with the weight read)
        wait_seconds = clock.get("weights_wait_s")
        overlap = (f" (read on threads; {wait_seconds:.2f} s waited)" if in_background and self.compiled.building
                   else f" (read while compiling; {wait_seconds:.2f} s not hidden)" if in_background else "")
        log_startup(self.startup_seconds, overlap)

    # ---- lazy CUDA-graph capture (lazy capture) ------------------------------------------
    @property
    def has_pending_captures(self) -> bool:
        return self.lazy_capture and self.compiled.has_pending_captures

    @property
    def has_wanted_captures(self) -> bool:
        return self.lazy_capture and self.compiled.has_wanted_captures

    def capture_pending(self) -> bool:
        """Capture one more pending CUDA-graph size; call only between steps, with no step in flight
        (the engine's rule). Returns whether sizes are still pending. The KV cache was sized after
        every size's graph memory, so this fits; should graphs outgrow what was kept for them, or
        a capture run out of memory, lazy capture stops for good with a warning (the sizes left
        run on the next captured size up, or without graphs) rather than fail a later step."""
        if not self.has_pending_captures:
            return False
        if not self.compiled.wait_for_build(timeout=0):  # graphs are captured over the built forward
            return True
        t0 = time.perf_counter()
        if self.device.type == "cuda":  # (tests emulate piece graphs on the CPU)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the steps' cached activation blocks: graphs take from the pool
        estimate = self.graph_estimate
        if estimate is not None and self.compiled.graph_memory_bytes >= estimate.bytes():
            return self._stop_lazy_capture(f"graphs use {self.compiled.graph_memory_bytes / 2**30:.2f} GiB, "
                                           f"all of the {estimate.bytes() / 2**30:.2f} GiB kept for them")
        try:
            self.compiled.capture_next()
        except torch.OutOfMemoryError as e:
            return self._stop_lazy_capture(f"a capture ran out of GPU memory ({e})")
        self._lazy_capture_seconds += time.perf_counter() - t0
        if not self.compiled.has_pending_captures:
            logger.info("CUDA graphs: every size captured (%.2f s between steps); %.2f GiB used",
                        self._lazy_capture_seconds, self.compiled.graph_memory_bytes / 2**30)
            self._keep_measured_profile()
            return False
        return True

    def _keep_measured_profile(self) -> None:
        """Once a first start's lazy capture ends: the graphs' memory as measured, for the next start."""
        self.memory_profiler.keep_measured(self.graph_estimate, self.compiled)

    def _stop_lazy_capture(self, reason: str) -> bool:
        logger.warning("CUDA graphs: %s; %d sizes stay without graphs", reason, self.compiled.num_pending_captures)
        self._keep_measured_profile()
        self.lazy_capture = False
        self.compiled.drop_pending_captures()
        return False

    def _memory_profile_cache(self, sched: SchedulerConfig, want_graphs: bool
                              ) -> Optional[kv_sizing.MemoryProfileCache]:
        """Where the profile of this forward and shape is kept: only for kiln's forward with a compile
        cache (its key names the model, compile config and kiln's source), without a draft model."""
        if self._profile_key is None or self._has_draft:
            return None
        return kv_sizing.MemoryProfileCache(
            self._profile_artifacts, self._profile_key, max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs, max_model_len=self.max_model_len, kv_shape=repr(self.kv_shape),
            graphs=want_graphs, verify=repr(self._verify),
            total_memory=torch.cuda.get_device_properties(self.device).total_memory)

    def _make_kv_caches(self, cache_config: CacheConfig, activation_bytes: int) -> tuple[int, list[torch.Tensor]]:
        """Size the cache after the activations and the CUDA graphs, the same on every rank, and allocate it."""
        draft = self.proposer.kv_shape if isinstance(self.proposer, DraftProposer) else None
        # A draft model's cache holds as many blocks (same ids): one budget, per-block cost summed.
        budget_shape = self.kv_shape if draft is None else _SummedBlocks(self.kv_shape, draft)
        num_blocks = kv_sizing.decide_num_blocks(cache_config, budget_shape, self.device, activation_bytes,
                                                 self.graph_estimate, self.max_model_len)
        num_blocks = min_over_ranks(num_blocks, self.device)
        if draft is not None:
            self.draft_kv_caches = kv_sizing.allocate_kv_caches(draft, num_blocks, self.device)
        return num_blocks, kv_sizing.allocate_kv_caches(self.kv_shape, num_blocks, self.device)

    def _make_proposer(self, spec: SpeculativeConfig, model_config: ModelConfig, cache_config: CacheConfig,
                       sched: SchedulerConfig) -> Optional[NgramProposer | DraftProposer]:
        if spec.method == "ngram":
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        if spec.method == "draft":
            target = DraftTarget(model_config, self.device, self.dtype, self.arch.vocab_size, self.max_model_len,
                                 self.block_size, sched.max_num_batched_tokens, sched.max_num_seqs)
            return DraftProposer(spec, target, cache_config, self.kernels)
        return None

    def _artifact_name(self) -> str:
        # A rank's shard is a different graph from the whole model's; ranks never share a directory.
        name = self.loaded.name
        if self.stage.size > 1:
            return f"{name}-tp{self.tp.size}-pp{self.stage.size}-stage{self.stage.rank}-rank{self.tp.rank}"
        return name if self.tp.size == 1 else f"{name}-tp{self.tp.size}-rank{self.tp.rank}"

    # ---- one step -------------------------------------------------------------------------------
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, after: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Prepare the inputs and enqueue forward, logits and sampling; on a GPU it returns while
        they run. Everything read from the requests is read here, except in a step a grammar
        constrains: its bitmask fill and sampling read them until ``collect`` (the engine changes a
        request only after its step is collected).

        ``after``: the step launched before this one and not yet collected (the engine scheduled
        this one ahead); a decode whose input token is still a placeholder takes the token that
        step sampled for it, on the device, without a read-back."""
        if sched.is_empty:
            return LaunchedStep()
        drafts = self.proposer.propose(sched) if self.proposer is not None else {}
        num_proposed = {rid: len(d) for rid, d in drafts.items()}
        if drafts and self.compiled.verify_graphs is not None:
            drafts = pad_drafts(sched, drafts)
        lora_slots = self.lora.token_slots(s.request for s in sched.scheduled) if self.lora is not None else None
        inputs, sample_rows = self.input_batch.prepare(sched, drafts, lora_slots)
        if self.encoder_cache is not None:
            inputs.mm_embeds = self._image_embeds(sched)
        if self.input_batch.placeholder_rows:
            inputs.device_input_ids = self._fed_input_ids(self.input_batch.placeholder_rows, after)
        if self.link is not None:
            self.link.receive(inputs.num_tokens)  # the stage before's hidden states (stage 0: none)
        out = self.compiled.run(inputs)
        if self.link is not None and not self.stage.is_last:
            self.link.send(out.hidden[:inputs.num_tokens])  # logits, sampling: the last stage's
            return LaunchedStep()
        prompt_logprobs = self._prompt_logprobs(sched, out.hidden)
        embeddings = self._pool(sched, out.hidden)
        if not sample_rows:
            return LaunchedStep(prompt_logprobs=prompt_logprobs, embeddings=embeddings)
        greedy_ids = None
        contiguous = len(sample_rows) == sample_rows[-1] + 1  # rows 0..n-1 (decode-only): a view
        rows = slice(0, len(sample_rows)) if contiguous else host_to_device(sample_rows, self.device)
        if out.logits is not None:  # a full graph computed them already
            logits, greedy_ids = out.logits[rows], out.greedy_ids[rows]
        else:
            # Every rank: under tensor parallelism the logits are gathered over the group.
            logits = self.compiled.compute_logits(out.hidden[rows])  # [num_sampled, vocab] float32
        if not self.is_sampler:  # rank 0 (of the last stage) alone samples
            return LaunchedStep()
        requests = [s.request for s in sched.scheduled if s.samples]  # one per sample row, or 1 + drafts rows
        request_ids = [r.request_id for r in requests]
        if drafts:
            draft_lists = [drafts.get(rid, []) for rid in request_ids]
            return LaunchedStep(request_ids, verified=verify(self.sampler, logits, requests, draft_lists),
                                num_proposed=[num_proposed.get(rid, 0) for rid in request_ids],
                                prompt_logprobs=prompt_logprobs, embeddings=embeddings)
        if self.bitmasks.constrains(requests):
            # On a GPU the forward is still running: the bitmask is filled on a worker thread
            # meanwhile, while the engine processes the previous step; collect samples.
            constrained = ConstrainedStep(logits, requests, greedy_ids, self.bitmasks.start_fill(requests))
            return LaunchedStep(request_ids, constrained=constrained, prompt_logprobs=prompt_logprobs,
                                embeddings=embeddings)
        samples = self.sampler.launch(logits, requests, greedy_ids)
        self._start_read_back(samples)
        return LaunchedStep(request_ids, samples, prompt_logprobs=prompt_logprobs, embeddings=embeddings)

    def _image_embeds(self, sched: SchedulerOutput) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The encoder cache brought up to date for this step, and the embeddings of its image
        tokens with their token rows (each request's first row from the step's query starts)."""
        self.encoder_cache.update(sched.freed_encoder_hashes, sched.encoder_inputs)
        qsl = self.input_batch.buffers.qsl_np
        chunks = [(s.request, int(qsl[i]), s.start, s.start + s.num_new_tokens - s.num_lookahead_tokens)
                  for i, s in enumerate(sched.scheduled) if s.request.mm_features]
        return self.encoder_cache.gather(chunks) if chunks else None

    def _fed_input_ids(self, placeholders: list[tuple[int, str]], after: Optional[LaunchedStep]) -> torch.Tensor:
        """Token ids of rows [0, last placeholder row] on the device: each placeholder row takes
        the token ``after`` sampled for its request, every other row its id in the host mirror."""
        if after is None or after.samples is None:
            raise RuntimeError("a decode's input token is still in flight, but no step in flight sampled it")
        sampled = after.samples.token_ids  # [rows of `after`], in after.request_ids order
        index = {rid: i for i, rid in enumerate(after.request_ids)}
        num_rows = placeholders[-1][0] + 1
        src = [index[rid] for _, rid in placeholders]
        if len(placeholders) == num_rows:  # every row up to the last is a placeholder (the usual decode)
            if src == list(range(num_rows)):  # in the order of the step before: a view, no kernel
                return sampled[:num_rows]
            return sampled.index_select(0, host_to_device(src, self.device, torch.int64))
        known = self.input_batch.buffers.ids_np[:num_rows].tolist()
        gather = [0] * num_rows
        for (row, _), i in zip(placeholders, src):
            gather[row], known[row] = i, -1
        packed = host_to_device(gather + known, self.device, torch.int64)
        return torch.where(packed[num_rows:] >= 0, packed[num_rows:], sampled.index_select(0, packed[:num_rows]))

    def _start_read_back(self, samples: SampledTokens) -> None:
        """On a GPU: copy the sampled ids to pinned host memory behind the sampling, so ``collect``
        waits for this step and not for one launched after it. Two buffers take turns: at most two
        steps are in flight, and a step is collected before the step after the next is launched."""
        if self.device.type != "cuda":
            return
        n = samples.num_reqs
        turn = self._read_back_turn = 1 - self._read_back_turn
        host = self._read_back[turn]
        if host is None or host.shape[0] < n:
            host = self._read_back[turn] = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host[:n].copy_(samples.token_ids, non_blocking=True)
        done = self._read_back_done[turn]
        done.record()
        samples.host_copy = (host, done)

    def _pool(self, sched: SchedulerOutput, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Embeddings of the requests whose prompt ends in this step: the last token's final hidden
        state, or the mean over the prompt (summed chunk by chunk), L2-normalized."""
        done: dict[str, list[float]] = {}
        row = 0
        for s in sched.scheduled:
            req, n = s.request, s.num_new_tokens
            if req.pooling == "mean":
                chunk_sum = hidden[row:row + n].float().sum(dim=0)
                total, count = self._pool_sums.get(req.request_id, (0.0, 0)) if s.start > 0 else (0.0, 0)
                self._pool_sums[req.request_id] = (chunk_sum + total, count + n)
            if req.pooling is not None and s.samples:
                if req.pooling == "mean":
                    total, count = self._pool_sums.pop(req.request_id)
                    vector = total / count
                else:
                    vector = hidden[row + n - 1].float()
                done[req.request_id] = torch.nn.functional.normalize(vector, dim=0).tolist()
            row += n
        return done if self.is_sampler else {}

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: Optional[torch.Tensor]) -> dict[str, PromptLogprobs]:
        """Logprobs of the prompt tokens this step's prefill chunks predict, for requests that ask
        (rare: computed and read back here, over the chunk's rows only). Every rank computes the
        logits (they are gathered over the group); rank 0 returns them."""
        found: dict[str, PromptLogprobs] = {}
        row = 0
        for s in sched.scheduled:
            start, n, req = s.start, s.num_new_tokens, s.request
            num_top = req.sampling_params.prompt_logprobs
            # Row q predicts token q + 1; only prompt tokens after the first are scored.
            end = min(start + n, req.num_prompt_tokens - 1)
            if num_top is not None and hidden is not None and start < end:
                logprobs = self.compiled.compute_logits(hidden[row:row + end - start]).float().log_softmax(-1)
                found[req.request_id] = _prompt_entries(logprobs, req.prompt_token_ids, start, num_top)
            row += n
        return found if self.is_sampler else {}

    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step and read its tokens back to the host."""
        if launched.verified is not None:
            v = launched.verified.result()
            ids = launched.request_ids
            # Accepted fillers (pad_drafts) are emitted, but count as neither proposed nor accepted.
            counts = {rid: (p, min(a, p)) for rid, p, a in zip(ids, launched.num_proposed, v.num_accepted) if p}
            return RunnerOutput(dict(zip(ids, v.token_ids)), dict(zip(ids, v.logprobs)), counts,
                                prompt_logprobs=launched.prompt_logprobs, embeddings=launched.embeddings)
        samples = launched.constrained.sample(self.sampler) if launched.constrained is not None else launched.samples
        if samples is None:
            return RunnerOutput(prompt_logprobs=launched.prompt_logprobs, embeddings=launched.embeddings)
        out = samples.result()
        return RunnerOutput(dict(zip(launched.request_ids, out.token_ids)),
                            dict(zip(launched.request_ids, out.logprobs)),
                            prompt_logprobs=launched.prompt_logprobs, embeddings=launched.embeddings)

    def forget(self, request_id: str) -> None:
        """Drop per-request state (seeded generators, grammar matchers, the draft's progress) once a
        request finishes."""
        self.sampler.forget(request_id)
        self.bitmasks.forget(request_id)
        self._pool_sums.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.forget(request_id)

    def shutdown(self) -> None:
        """Stop the runner's helper thread (the grammar bitmask worker) and any background build, and
        let go of the device memory the runner holds (weights, KV cache, CUDA graphs), so a later
        engine in the same process sizes its KV cache against a free device."""
        self.bitmasks.shutdown()
        if self.compiled is not None:
            self.compiled.cancel_build()
        self.compiled = self.model = self.proposer = self.input_batch = self.encoder_cache = None
        self.kv_caches = self.draft_kv_caches = None
        if self.device.type == "cuda":
            gc.collect()  # the graphs and caches sit in reference cycles (forward contexts, closures)
            torch.cuda.empty_cache()


# compile.cudagraph of a pipeline stage before the last: without the full graphs.
_WITHOUT_FULL = {"none": "none", "piecewise": "piecewise", "full": "none", "full_and_piecewise": "piecewise"}


def verify_shape(spec: SpeculativeConfig, sched: SchedulerConfig) -> VerifyShape:
    """The verify steps speculation can make: k + 1 tokens for each of up to max_batch_size requests."""
    return VerifyShape(spec.num_speculative_tokens + 1, min(spec.max_batch_size, sched.max_num_seqs))


def pad_drafts(sched: SchedulerOutput, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Every speculating request's proposal filled up to its lookahead slots (already allocated)
    with copies of its last token, so a verify step is uniform (k + 1 tokens a request) and
    replays a full CUDA graph rather than piecewise ones. Verification is exact for any
    deterministic proposal, so a filler is kept only where it is the target's own choice: the
    emitted tokens do not change. Without any proposal the step stays a plain decode."""
    padded = {}
    for s in sched.scheduled:
        if s.num_lookahead_tokens and s.samples:
            rid, n = s.request.request_id, s.request.num_tokens
            draft = drafts.get(rid, [])
            filler = draft[-1] if draft else s.request.token_ids_slice(n - 1, n)[0]
            padded[rid] = draft + [filler] * (s.num_lookahead_tokens - len(draft))
    return padded


def _check_verify_capture_sizes(spec: SpeculativeConfig, sched: SchedulerConfig, compile_config: CompileConfig) -> None:
    """A verify step runs batch x (k + 1) tokens: through full graphs captured per number of
    requests, else through the piecewise graphs per number of tokens; say so when the capture
    sizes stop short of the largest verify step speculation allows."""
    if not spec.enabled or compile_config.cudagraph == "none":
        return
    shape = verify_shape(spec, sched)
    largest = max(compile_config.capture_sizes, default=0)
    if compile_config.cudagraph in ("full", "full_and_piecewise") and largest < shape.max_num_reqs:
        logger.warning("speculative decoding verifies up to %d requests a step (speculative.max_batch_size) but the "
                       "largest of compile.capture_sizes is %d: larger verify steps run without full CUDA graphs",
                       shape.max_num_reqs, largest)
    if compile_config.cudagraph == "piecewise" and largest < shape.max_num_reqs * shape.query_len:
        logger.warning("speculative decoding verifies up to %d tokens a step (speculative.max_batch_size x (k + 1)) "
                       "but the largest of compile.capture_sizes is %d: larger verify steps run without CUDA graphs",
                       shape.max_num_reqs * shape.query_len, largest)


@dataclass(frozen=True)
class _SummedBlocks:
    """The KV budget's view of a target and a draft cache over the same block ids."""

    target: KVShape
    draft: KVShape

    @property
    def block_size(self) -> int:
        return self.target.block_size

    @property
    def bytes_per_block(self) -> int:
        return self.target.bytes_per_block + self.draft.bytes_per_block


def _prompt_entries(logprobs: torch.Tensor, prompt_ids: list[int], start: int, num_top: int) -> PromptLogprobs:
    """logprobs: [rows, vocab], row k at prompt position start + k, scoring the token after it."""
    targets = torch.tensor(prompt_ids[start + 1:start + 1 + logprobs.shape[0]], device=logprobs.device)
    own = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    top_lp, top_ids = (logprobs.topk(num_top, dim=-1) if num_top > 0 else (None, None))
    top_lp = top_lp.tolist() if top_lp is not None else [[] for _ in own]
    top_ids = top_ids.tolist() if top_ids is not None else [[] for _ in own]
    entries = []
    for k, (token, lp) in enumerate(zip(targets.tolist(), own)):
        entry = dict(zip(top_ids[k], top_lp[k]))
        entry[token] = lp
        entries.append((start + 1 + k, entry))
    return entries


def _stop_ids(eos: tuple[int, ...]) -> Optional[list[int]]:
    """The ids a grammar may end on: every EOS id the scheduler stops at."""
    return [int(e) for e in eos] or None
