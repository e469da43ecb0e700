"""LLMEngine: the engine core that the ``LLM`` API and the server both drive.

Step pipeline: the output processing of step k (detokenize, stop strings) runs while step k+1
runs on the device (or on the rank processes). One ``step()`` call::

    result_k  = executor.wait(handle_k)             # step k's tokens (the device -> host sync)
    updated   = scheduler.update(sched_k, result_k) # append tokens, finish on eos / stop ids / length
    sched_k+1 = scheduler.schedule()                # who runs next, which blocks
    handle    = executor.submit(sched_k+1)          # step k+1 starts ...
    outputs   = output_processor.process(updated)   # ... while step k is detokenized, stop strings
    finish the samples that hit a stop string       #     found; those are freed and forgotten
    return outputs                                  # step k's RequestOutputs

    host     | wait k | update k, schedule k+1 | submit k+1 | process k  | wait k+1 | update k+1 ...
    device   ... k ]     idle                                [ k+1 ........... ]

So ``step()`` returns the outputs of the step that just completed, one call after it was
scheduled; the first call after an idle engine returns none.

Scheduling ahead: where the executor can take a step before the one in flight has returned its
tokens (``can_schedule_ahead``: one runner on a GPU, which feeds a decode's input token from the
step before on the device) and every request of the step in flight is sampled plainly (no
penalties, logit edits, grammar, speculation or pooling), step k+1 is scheduled and launched
before step k is waited for, so the host's scheduling and input preparation run while the device
computes step k::

    host     | schedule k+1 (ahead) | submit k+1 | wait k | update k | process k | schedule k+2 ...
    device   ... k ...................................] [ k+1 ..................................

(``Scheduler.schedule_ahead``: step k's tokens are placeholders until ``update``; a request
stopped by a token in step k holds a wasted row in step k+1, as one stopped by a stop string does.)
Blocks freed while two steps are queued may be handed out again at once: the device runs the steps
in order on one stream, so a later step's writes always come after the earlier step's.

Lazy CUDA-graph capture (``compile.startup`` auto or fast): the sizes the runner did not capture at
start-up are captured one at a time between steps, with no step in flight (a capture rewrites the
input buffers and graph outputs a step reads): a call whose capture is due waits for the step in
flight, returns its outputs without submitting another, and the next call captures one size
before it submits. Never before the first step; a size a batch ran without (it would have
replayed that graph were every size captured) at the next step boundary; the others only while
the engine is idle (``capture_idle``, which the engine core's loop calls), so a busy engine's steps
never wait for a graph they do not use. While kiln's forward is built in the background on CUDA
every size waits for it: no capture is due, and the steps run the model eagerly without graphs.

``schedule`` needs only what ``update`` knows (token ids, eos, max_tokens), never the text.
``overlap=False`` (tests' reference) runs each step to the end instead: schedule, submit, wait,
update, process.

Rules:
- Every request that enters leaves through a finish (stop, length, abort, error) and gives its
  blocks back; bad input is refused in ``add_request`` with a ValueError that says what to change,
  and a refused request leaves nothing behind. ``InputProcessor`` does the tokenizing and checking
  and is safe from any thread, so the server runs it before the engine thread sees a request.
- One request's failure is its own: an exception while processing its output ends it with
  ``RequestOutput.error`` (its blocks freed), and the step's other requests go on. A step that
  fails as a whole (the device, a rank) still fails the engine, so every input a step reads from
  a request (token ids, seeds) is checked before the request enters.
- A request finished while its step is in flight (a stop string found in ``process``, an abort
  between calls) gives its blocks back at once; the step still writes its K/V into them. That is
  safe because blocks are handed out only by ``schedule``, which runs after ``wait`` for the step
  in flight (or, scheduling ahead, launches only behind it on the same stream), and nothing else
  allocates: ``abort_request`` and ``add_request`` only free or queue.
  ``update`` drops the finished request's token from that step, and it is never reported again.
- Since step k+1 is scheduled before step k's stop strings are known, a request stopped by one
  still holds its seat, budget and blocks in step k+1 (one wasted row), so a waiting request may
  be admitted a step later than in a serial run. Greedy and seeded tokens do not depend on the
  batch; unseeded random draws (one shared generator) may differ from a serial run.
- Nothing the runner reads for a step changes between ``submit`` and ``wait`` (tokens and
  num_computed_tokens move in ``update`` only), so an executor may run the step at either point.
- ``has_unfinished_requests`` counts the step in flight, so a caller's loop drains it; a step
  with an empty schedule is never submitted.

Start-up says what it is doing: one line naming the model, dtype, device and compile modes before
anything loads (``start_line``), and a ``StartupReport`` once built, whose ``ready_line`` the
``LLM`` API and the server print. Its KV numbers count usable blocks, as ``/metrics`` does.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Mapping, Optional, Union

from kiln.clock import age_at_kiln_import, process_age_s
from kiln.config import EngineConfig
from kiln.lora_request import LoRARequest
from kiln.models.loader import describe_quantization, resolve_device, resolve_dtype
from kiln.outputs import RequestDelta, RequestOutput
from kiln.runtime.executor import make_executor
from kiln.runtime.input_processor import InputProcessor, TokenizedPrompt
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.multimodal import MultimodalProcessor
from kiln.runtime.output_processor import OutputProcessor
from kiln.runtime.request import Request, RequestStatus
from kiln.runtime.scheduler import Scheduler
from kiln.runtime.scheduler_output import SchedulerOutput
from kiln.runtime.spec_stats import SpecDecodeStats
from kiln.runtime.startup import runner_timeline
from kiln.runtime.structured_output import GrammarCompiler
from kiln.sampling_params import SEED_MIN, SamplingParams

logger = logging.getLogger(__name__)

Prompt = Union[str, list[int], TokenizedPrompt]

# An idle engine whose graphs wait for a background build waits this long for it per capture_idle call
# (then takes new requests): a loop that calls it does not spin.
BUILD_POLL_S = 0.05


SHOWN_S = 0.05  # the ready line leaves out phases shorter than this


@dataclasses.dataclass(frozen=True)
class StartupReport:
    """What the ready line says: the KV cache requests can use and where start-up time went, from
    the launch of the process (``timeline``: phases that add up to ``since_launch_s``)."""

    num_usable_blocks: int  # block 0, the pool's null block, excluded (as /metrics counts them)
    block_size: int
    startup_s: float  # building the engine, wall clock
    phases_s: Mapping[str, float]  # ModelRunner.startup_seconds of a runner in this process, else empty
    building: bool = False  # kiln's forward is still being built in the background (compile.startup)
    timeline: tuple[tuple[str, float], ...] = ()  # (phase, seconds) from the process's launch to ready
    since_launch_s: float = 0.0  # the process's age when it was ready

    @property
    def num_kv_tokens(self) -> int:
        return self.num_usable_blocks * self.block_size

    @classmethod
    def measured(cls, num_usable_blocks: int, block_size: int, startup_s: float, phases_s: Mapping[str, float],
                 building: bool, age_at_import: float, age_at_engine: float) -> "StartupReport":
        """The report of an engine built ``startup_s`` seconds from when this process was
        ``age_at_engine`` seconds old (``kiln`` imported at ``age_at_import``)."""
        rows = [("interpreter", age_at_import), ("imports and config", max(0.0, age_at_engine - age_at_import))]
        if phases_s:  # the runner's phases (kiln.runtime.startup), then what none accounts for
            rows += runner_timeline(phases_s, startup_s)
        else:  # the ranks run elsewhere: each logs its own phases
            rows.append(("engine", startup_s))
        return cls(num_usable_blocks, block_size, startup_s, dict(phases_s), building, tuple(rows),
                   sum(s for _, s in rows))

    def seen_from(self, age_at_spawn: float, age_now: float) -> "StartupReport":
        """This report (an engine-core process's) as its frontend sees it: the frontend's own start
        until it spawned the engine core, then the core's phases, then the hand-over until now."""
        rows = (("frontend start", age_at_spawn),) + tuple((f"engine core: {name}", s) for name, s in self.timeline)
        rows += (("hand-over", max(0.0, age_now - age_at_spawn - self.since_launch_s)),)
        return dataclasses.replace(self, timeline=rows, since_launch_s=sum(s for _, s in rows))

    def ready_line(self, url: Optional[str] = None) -> str:
        line = (f"kiln: ready{f' at {url}' if url else ''} — KV cache {self.num_kv_tokens} tokens "
                f"({self.num_usable_blocks} blocks of {self.block_size}), ")
        if not self.timeline:
            return line + f"start-up {self.startup_s:.1f} s"
        shown = ", ".join(f"{name} {s:.1f} s" for name, s in self.timeline if s >= SHOWN_S)
        building = "; kiln's forward is built in the background" if self.building else ""
        return line + f"{self.since_launch_s:.1f} s from launch ({shown}){building}"


def engine_device_type(config: EngineConfig) -> str:
    """The device type the config's ``auto`` defaults are resolved for: this host's device, or under
    Ray (whose nodes decide) the one asked for, else CUDA when this host has it."""
    if config.parallel.backend == "ray" and config.model.device != "auto":
        return config.model.device
    return resolve_device(config.model.device).type


def resolve_config(config: EngineConfig, entrypoint: str = "server") -> EngineConfig:
    """``config`` with its ``auto`` defaults decided for the engine's device and ``entrypoint``
    (kiln.config.resolve_for_device)."""
    return config.resolved(engine_device_type(config), entrypoint)


# How the start line says when kiln's forward is built (ResolvedCompileConfig.build).
BUILD_WORDS = {"startup": "", "background": " (built in the background)",
               "background_when_cold": " (loaded before ready when cached, else built in the background)"}


def start_line(config: EngineConfig) -> str:
    """The line logged before anything loads: what runs, in which precision, where and how compiled
    (the resolved values: ``auto`` shows what it chose)."""
    model, modes, tp_size = config.model, config.compile, config.parallel.tensor_parallel_size
    if config.parallel.backend == "ray":  # the cluster's nodes decide; this host may have no GPU
        dtype, device = model.dtype, f"{model.device} (Ray cluster)"
    else:
        device = resolve_device(model.device)
        dtype = str(resolve_dtype(model.dtype, device)).removeprefix("torch.")
    sched, sizes = config.scheduler, modes.capture_sizes
    weights = describe_quantization(model)
    line = (f"kiln: model {model.model}, {dtype} on {device}, {weights + ', ' if weights else ''}compile.mode={modes.mode}"
            f"{BUILD_WORDS[modes.build]}, "
            f"compile.cudagraph={modes.cudagraph}")
    if sched.is_resolved:
        line += f", max_num_seqs={sched.max_num_seqs}, max_num_batched_tokens={sched.max_num_batched_tokens}"
    if modes.cudagraph != "none" and sizes:
        line += f", {len(sizes)} capture sizes {sizes[0]}..{sizes[-1]}"
    pp_size = config.parallel.pipeline_parallel_size
    return (line + (f", tensor_parallel_size={tp_size}" if tp_size > 1 else "")
            + (f", pipeline_parallel_size={pp_size}" if pp_size > 1 else ""))


class LLMEngine:
    def __init__(self, config: EngineConfig, overlap: bool = True, delta_outputs: bool = False,
                 entrypoint: str = "server"):
        """``overlap=False`` runs each step to the end before returning (a reference for tests).
        ``entrypoint``: what drives it ("server" or "offline", the ``LLM`` class), for ``compile.startup=auto``.
        ``delta_outputs``: ``step`` and ``abort_request`` return ``RequestDelta``s, each only what is
        new since the request's last one (``OutputProcessor(delta=True)``), as the engine-core process
        sends them."""
        if config.parallel.data_parallel_size != 1:  # the server's DataParallelClient runs one per replica
            raise ValueError(f"parallel.data_parallel_size={config.parallel.data_parallel_size} is for serving "
                             "(kiln serve: one engine core per replica behind one frontend); an LLMEngine or "
                             "the offline LLM runs one replica: set parallel.data_parallel_size=1")
        t_start, age_at_engine = time.perf_counter(), process_age_s()
        config = resolve_config(config, entrypoint)  # every `auto` decided here, before anything is built
        logger.info(start_line(config))
        self.config = config
        self._overlap = overlap
        self._in_flight: Optional[tuple[SchedulerOutput, Any]] = None  # (step, executor handle)
        self.executor = make_executor(config.model, config.cache, config.compile, config.parallel, config.scheduler,
                                      config.speculative, config.lora, config.kernels)
        self.tokenizer = self.executor.tokenizer
        self.max_model_len = self.executor.max_model_len
        self.kv_manager = KVCacheManager(
            self.executor.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, config.speculative,
                                   max_loras=config.lora.max_loras if config.lora.enabled else 0)
        self.lora_stats: dict[str, dict[str, int]] = {}  # adapter name -> requests, prompt and generated tokens
        self.spec_stats = SpecDecodeStats(config.speculative.num_speculative_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, delta=delta_outputs)
        self._schedule_ahead = (overlap and getattr(self.executor, "can_schedule_ahead", False)
                                and not config.speculative.enabled)
        runner = getattr(self.executor, "runner", None)  # only the one-process executor holds one here
        # One compiler (and so one grammar cache) where the runner is in this process.
        self.grammars = runner.grammars if runner is not None else GrammarCompiler(
            self.tokenizer, self.executor.vocab_size,
            list(self.executor.eos_token_ids) or None)
        # A vision-language model's images: its processor, and its runner's encoder cache in this process.
        self.mm_processor = self._mm_processor(runner)
        self.inputs = InputProcessor(self.tokenizer, self.executor.vocab_size, self.max_model_len, self.grammars,
                                     self.mm_processor)
        self._captures_pending = self.executor.has_pending_captures
        self._capture_held = False  # the last step() left nothing in flight: capture before the next step
        self._num_steps_done = 0
        phases = dict(runner.startup_seconds) if runner is not None else {}
        self.startup = StartupReport.measured(self.kv_manager.num_usable_blocks, config.cache.block_size,
                                              time.perf_counter() - t_start, phases,
                                              runner is not None and runner.compiled.building,
                                              age_at_kiln_import(), age_at_engine)

    def _mm_processor(self, runner: Any) -> Optional[MultimodalProcessor]:
        """A vision-language model's image processing; None for a text model, and where the ranks
        run in processes of their own (images are served by ``parallel.backend=uni``)."""
        if runner is None or runner.encoder_cache is None:
            return None
        return MultimodalProcessor.from_model_dir(runner.loaded.hf_dir)

    # ---- requests -------------------------------------------------------------------------------
    def tokenize(self, prompt: Union[str, list[int]], add_special_tokens: bool = True) -> list[int]:
        return self.inputs.tokenize(prompt, add_special_tokens)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError for a request that cannot run as asked."""
        self.inputs.validate(prompt_token_ids, params)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        add_special_tokens: bool = True,
        pooling: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Queue a request (n samples); a refusal or failure leaves nothing behind. ``pooling``
        ("last" | "mean"): an embedding request, which runs its prompt and returns its vector.
        ``lora_request``: the adapter it runs with (read and checked here on first use)."""
        if self.output_processor.has(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if pooling not in (None, "last", "mean"):
            raise ValueError(f"pooling must be last or mean, got {pooling!r}")
        if pooling is not None and params.n != 1:
            raise ValueError("n must be 1 for an embedding request")
        processed = self.inputs.process(prompt, params, add_special_tokens)
        if lora_request is not None:
            self.add_lora(lora_request)
        samples = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=processed.token_ids,
                sampling_params=params if params.seed is None else _with_seed(params, params.seed + i),
                eos_token_ids=self.executor.eos_token_ids,
                max_model_len=self.max_model_len,
                priority=priority,
                pooling=pooling,
                lora_request=lora_request,
                mm_features=processed.mm_features,
            )
            for i in range(params.n)
        ]
        self.output_processor.add(request_id, processed.text, samples)
        try:
            for req in samples:
                self.scheduler.add_request(req)
        except BaseException:
            self.abort_request(request_id)  # the samples already queued give their place back
            raise

        if lora_request is not None:
            counts = self._lora_counts(lora_request.lora_name)
            counts["requests"] += 1
            counts["prompt_tokens"] += len(processed.token_ids) * params.n

    # ---- LoRA adapters --------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> bool:
        """Load adapter ``lora`` (read and checked: ValueError naming the file and field); False when
        it was loaded already."""
        if not self.config.lora.enabled:
            raise ValueError(f"LoRA adapter {lora.lora_name!r} asked for, but this engine serves none; "
                             "start it with lora={...} (lora.enabled=true)")
        return self.executor.add_lora(lora)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload adapter ``lora_id`` (requests still running with it read it again from its path)."""
        return self.config.lora.enabled and self.executor.remove_lora(lora_id)

    def _lora_counts(self, name: str) -> dict[str, int]:
        return self.lora_stats.setdefault(name, {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0})

    def abort_request(self, request_id: str) -> Optional[Union[RequestOutput, RequestDelta]]:
        """Finish a user request now (all its samples) and free its blocks."""
        sample_ids = self.output_processor.sample_ids(request_id)
        for sid in sample_ids:
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
        self.executor.forget(sample_ids)
        return self.output_processor.abort(request_id)

    # ---- stepping -------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[Union[RequestOutput, RequestDelta]]:
        """Advance one step; returns the RequestOutputs of the step that completed in this call
        (``finished_only``: of the requests it finished)."""
        if self._capture_held:
            self._capture_held = False
            self._capture_between_steps()
        hold = self._capture_due() and (self._in_flight is not None or not self._overlap)
        if self._overlap and self._in_flight is not None and not hold and self._can_schedule_ahead(self._in_flight[0]):
            in_flight = self._in_flight
            sched = self.scheduler.schedule_ahead(in_flight[0])  # step k+1, step k still running
            self._in_flight = None
            following = None if sched.is_empty else (sched, self.executor.submit(sched, after=in_flight[1]))
            self._in_flight = in_flight
            try:
                updated, logprobs = self._wait_in_flight()  # step k
            finally:
                self._in_flight = following
        elif self._overlap:
            updated, logprobs = self._wait_in_flight()  # step k
            if not hold:  # hold: nothing in flight, so the next call captures, then submits
                self._submit_next()  # step k+1 runs while ...
        else:
            if hold:
                self._capture_between_steps()
            self._submit_next()
            updated, logprobs = self._wait_in_flight()
        outputs = self._process(updated, logprobs, finished_only)  # ... step k is detokenized
        # Only for requests still running: a new request after idle never waits for a capture.
        self._capture_held = (hold and self._overlap and self._in_flight is None
                              and self.scheduler.has_unfinished_requests())
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            self._wait_in_flight()  # all in it hit a stop string: drain it, so an idle engine holds no step
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    @property
    def has_pending_captures(self) -> bool:
        """CUDA-graph sizes still to capture (lazy capture (``compile.startup`` auto or fast))."""
        return self._captures_pending

    def wait_for_build(self, timeout: Optional[float] = None) -> bool:
        """a background build (``compile.startup``): block until kiln's forward is built (or ``timeout`` seconds
        pass); the next step runs it. Returns whether no build is still running (always, without one)."""
        runner = getattr(self.executor, "runner", None)  # a background build needs the one-process executor
        return runner is None or runner.compiled.wait_for_build(timeout)

    @property
    def building(self) -> bool:
        """Whether a background build of kiln's forward is still running (steps run eagerly until the
        first one after it ends); safe to read from any thread."""
        return not self.wait_for_build(timeout=0)

    def capture_idle(self) -> bool:
        """Capture one pending CUDA-graph size now; for a caller whose engine is idle (no request
        unfinished, so no step in flight). Returns whether more are pending."""
        if self._captures_pending and not self.has_unfinished_requests():
            if not self.wait_for_build(timeout=BUILD_POLL_S):  # graphs wait for kiln's forward
                return True
            self._capture_held = False
            self._captures_pending = self.executor.capture_pending()
        return self._captures_pending

    def _capture_due(self) -> bool:
        # Busy: only a size a batch asked for (one capture, then every such step replays it); the
        # rest wait for an idle engine, so no decode waits behind a capture it does not use.
        return (self._captures_pending and self._num_steps_done > 0 and self.executor.has_wanted_captures
                and not self.building)  # graphs are captured over kiln's forward once it is built

    def _capture_between_steps(self) -> None:
        self._captures_pending = self.executor.capture_pending()

    def _can_schedule_ahead(self, in_flight: SchedulerOutput) -> bool:
        """Whether the step after ``in_flight`` may be scheduled before its tokens are back."""
        if not self._schedule_ahead:
            return False
        for s in in_flight.scheduled:  # finished ones too: the step was launched (sampled) with them
            req = s.request
            p = req.sampling_params
            if (s.num_lookahead_tokens or req.pooling is not None or p.edits_logits or p.repetition_penalty != 1.0
                    or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
                return False
        return True

    def _submit_next(self) -> None:
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self._in_flight = (sched, self.executor.submit(sched))

    def _wait_in_flight(self) -> tuple[list[Request], dict[str, Optional[dict[int, float]]]]:
        """Wait for the step in flight, if any, and update the scheduler with its tokens."""
        if self._in_flight is None:
            return [], {}
        sched, handle = self._in_flight
        self._in_flight = None  # before wait: a failed step is not waited for again
        result = self.executor.wait(handle)
        self._num_steps_done += 1
        self.spec_stats.add(result.spec_counts)
        if result.prompt_logprobs:
            self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        if result.embeddings:
            self.output_processor.add_embeddings(result.embeddings)
        return self.scheduler.update(sched, result.sampled_token_ids), result.logprobs

    def _process(self, updated: list[Request], logprobs: dict[str, Optional[dict[int, float]]],
                 finished_only: bool = False) -> list[Union[RequestOutput, RequestDelta]]:
        outputs, stopped, failed = self.output_processor.process(updated, logprobs, finished_only)
        for sid in stopped:
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_STOPPED)
        for sid in failed:  # freed now, like an abort; the step in flight drops their tokens
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
        finished = [r.request_id for r in updated if r.is_finished]
        for r in updated:
            if r.is_finished and r.lora_request is not None:
                self._lora_counts(r.lora_request.lora_name)["generation_tokens"] += len(r.output_token_ids)
        finished += [sid for sid in failed if sid not in finished]
        if finished:
            self.executor.forget(finished)
        return outputs

    def stats(self) -> dict:
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_free_blocks": self.kv_manager.num_free_blocks,
            "num_blocks": self.executor.num_blocks,
            "num_usable_blocks": self.kv_manager.num_usable_blocks,
            "num_free_encoder_tokens": self.scheduler.encoder_cache.num_free,  # image embeddings held: the rest
            "prefix_cache_hit_rate": self.kv_manager.hit_rate,
            **self.spec_stats.as_dict(),
            **({"lora": {name: dict(c) for name, c in self.lora_stats.items()}} if self.lora_stats else {}),
        }

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.grammars.shutdown()


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    # Each of n seeded samples gets its own seed, so they differ but stay reproducible; past the
    # largest seed they wrap around within the signed 64-bit range.
    seed = (seed - SEED_MIN) % (1 << 64) + SEED_MIN
    return dataclasses.replace(params, seed=seed, n=1)
