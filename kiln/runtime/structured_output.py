"""Structured outputs: grammars (xgrammar) that constrain which tokens a request may sample next.

Two parts, each with its rules:

``GrammarCompiler`` turns a ``StructuredOutputsParams`` into a compiled grammar.
- Compiling runs in a thread pool (``submit`` returns a future), never on the engine's step loop:
  the server awaits the future before the request enters the engine, so a schema xgrammar cannot
  compile is a 400 whose message is xgrammar's reason, and the engine finds it compiled.
- Results are cached by the constraint's ``key`` (the canonical schema text), so every request
  (and every sample of n) with the same schema shares one compiled grammar.
- It is safe from any thread; the xgrammar objects (tokenizer info, its compiler) are built on
  first use, so an engine that never sees a constraint never pays for them.

``GrammarBitmasks`` (rank 0's model runner) keeps one matcher per constrained request and fills
one step's token bitmask: a row of 32-bit words per sampled request, bit t set when token t may
come next.
- On a GPU the fill runs on a worker thread while the step's forward runs and the engine
  detokenizes the step before; the bitmask goes up from pinned host memory without waiting for
  the stream. The mask is applied to the constrained rows only; a step with none keeps the
  sampler's fast path.
- A matcher is reconciled with its request before every fill: tokens sampled since are accepted,
  and if the request holds fewer tokens than the matcher has accepted it rolls back (or is rebuilt
  from the request's tokens). So preemption, n > 1 (one matcher per sample), prefix caching (which
  touches only prompt blocks) and a step whose token was dropped all keep matcher and request in
  step, whatever the executor.
- A constraint with ``after_token_ids`` (a reasoning model's end-of-thinking marker) leaves its row
  open until those ids appear in the output; its matcher then starts on the token after them.
- A request whose grammar is complete may only stop (its stop tokens); a sampled token the matcher
  refuses (which masking rules out) ends constraining for that request, with a warning, instead of
  failing the step.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import torch

from kiln.errors import first_line
from kiln.runtime.request import Request
from kiln.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 1024


class GrammarError(ValueError):
    """A constraint xgrammar cannot compile; the message says why."""


def xgrammar_reason(error: Exception) -> str:
    """The first line of an xgrammar error, without the "[time] file.cc:line: " of its C++ logger."""
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first_line(error))


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, off the caller's thread, cached."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Optional[list[int]] = None,
                 max_threads: int = 2):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="kiln-grammar")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._xgr_compiler = None  # built on first use (xgrammar scans the whole vocabulary once)
        self.compile_seconds: dict[tuple[str, str], float] = {}

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar; its exception is a GrammarError naming the reason."""
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._futures[key] = future
            while len(self._futures) > _MAX_CACHED_GRAMMARS:
                self._futures.popitem(last=False)
        return future

    def compile(self, spec: StructuredOutputsParams):
        """Block until the grammar is compiled (at once when it is cached); GrammarError if it cannot be."""
        return self.submit(spec).result()

    def compiler(self):
        """The xgrammar compiler, built on first use (a scan of the tokenizer's vocabulary)."""
        with self._lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._xgr_compiler

    def _compile(self, spec: StructuredOutputsParams):
        import time

        kind, text = spec.key
        compiler = self.compiler()
        t0 = time.perf_counter()
        try:
            if kind == "json":
                # Compact JSON (no free whitespace): a small model cannot pad its way past max_tokens.
                # strict_mode: an object without additionalProperties takes only its listed keys
                # (OpenAI's strict: true), whatever the request's strict says.
                grammar = compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            elif kind == "json_object":  # any object, compact like the schemas
                grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            elif kind == "regex":
                grammar = compiler.compile_regex(text)
            elif kind == "choice":
                grammar = compiler.compile_grammar(choice_ebnf(spec.choice))
            else:
                grammar = compiler.compile_grammar(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError with the reason
            reason = xgrammar_reason(e)
            with self._lock:
                self._futures.pop(spec.key, None)  # a bad schema is not worth a cache slot
            raise GrammarError(f"structured_outputs: xgrammar cannot compile this {kind} constraint: {reason}") from None
        self.compile_seconds[spec.key] = time.perf_counter() - t0
        return grammar

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass
class _Matcher:
    matcher: object  # xgrammar.GrammarMatcher
    start: int  # where in the request's output the grammar begins (after ``after_token_ids``)
    num_accepted: int = 0  # output tokens from ``start`` on that this matcher has accepted
    broken: bool = False  # a refused token ended constraining


class GrammarBitmasks:
    """Per-request matchers and one step's bitmask; lives with the sampler (rank 0).

    ``start_fill`` is called once per step, after the step's forward is enqueued, and its future
    is read before the step is sampled. On a GPU the fill runs on one worker thread (xgrammar
    releases the GIL, and fills the rows on its own threads), so it overlaps both the forward and
    the engine's host work on the previous step; on the CPU it runs at once. The bitmask lives in
    one of two reused host buffers (pinned on a GPU, so its upload does not wait for the stream):
    a buffer is rewritten two steps later, long after that step was read back.
    """

    def __init__(self, compiler: GrammarCompiler, pin_memory: bool = False, background: bool = False):
        """On a GPU both: pinned host buffers, and fills on the worker thread."""
        self.compiler = compiler
        self.pin_memory = pin_memory
        self.background = background
        self._matchers: dict[str, _Matcher] = {}
        self._starts: dict[str, tuple[int, Optional[int]]] = {}  # (output searched so far, grammar start)
        self._batch = None  # xgrammar.BatchGrammarMatcher, made on first use
        self._buffers: list[torch.Tensor] = []  # [max rows, ceil(vocab / 32)] int32 each, grown on demand
        self._turn = 0
        self._worker: Optional[ThreadPoolExecutor] = None  # one thread: fills stay in step order

    def forget(self, request_id: str) -> None:
        """Drop a finished request's matcher; call it between steps (never while a fill runs)."""
        self._matchers.pop(request_id, None)
        self._starts.pop(request_id, None)

    @staticmethod
    def constrains(requests: list[Request]) -> bool:
        return any(r.sampling_params.structured_outputs is not None for r in requests)

    def start_fill(self, requests: list[Request]) -> Future:
        """A future of ``fill(requests)``, run on the worker thread (``background``) or at once.
        The requests must not change until the future is read (the engine changes them only after
        the step), and ``forget`` must wait for it too."""
        if not self.background:
            future: Future = Future()
            future.set_result(self.fill(requests))
            return future
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-bitmask")
        return self._worker.submit(self.fill, requests)

    def fill(self, requests: list[Request]) -> Optional[torch.Tensor]:
        """The bitmask of one step's sampled rows ([num_rows, ceil(vocab / 32)] int32 on the CPU),
        or None when no row is constrained. Rows without a live constraint allow every token. The
        tensor is a reused buffer: valid until the fill after next."""
        rows = [i for i, r in enumerate(requests) if r.sampling_params.structured_outputs is not None]
        if not rows:
            return None
        bitmask = self._buffer(len(requests))
        starts = {i: self._start(requests[i]) for i in rows}
        rows = [i for i in rows if starts[i] is not None]  # the others are still before their grammar
        live = self._synced([requests[i] for i in rows], [starts[i] for i in rows])
        live_rows = [i for i, state in zip(rows, live) if not state.broken]
        if len(live_rows) < len(requests):
            open_rows = sorted(set(range(len(requests))) - set(live_rows))
            bitmask[open_rows] = -1  # all allowed
        matchers = [state.matcher for state in live if not state.broken]
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, live_rows[0])
        elif matchers:  # xgrammar fills the rows on its own threads
            if self._batch is None:
                import xgrammar as xgr

                self._batch = xgr.BatchGrammarMatcher()
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, live_rows)
        return bitmask

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _buffer(self, num_rows: int) -> torch.Tensor:
        """The next of the two host buffers, as its first ``num_rows`` rows."""
        if not self._buffers or self._buffers[0].shape[0] < num_rows:
            words = (self.compiler.vocab_size + 31) // 32
            rows = max(num_rows, 2 * self._buffers[0].shape[0] if self._buffers else 8)
            self._buffers = [torch.full((rows, words), -1, dtype=torch.int32, pin_memory=self.pin_memory)
                             for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn][:num_rows]

    def _start(self, request: Request) -> Optional[int]:
        """Where the request's grammar begins in its output: 0, or just after the first occurrence
        of its ``after_token_ids``; None while they have not been generated."""
        marker = request.sampling_params.structured_outputs.after_token_ids
        if not marker:
            return 0
        output = request.output_token_ids
        searched, start = self._starts.get(request.request_id, (0, None))
        if searched > len(output) or (start is not None and start > len(output)):
            searched, start = 0, None  # tokens were taken back: search again
        if start is None:
            n = len(marker)
            for i in range(max(0, searched - n + 1), len(output) - n + 1):
                if tuple(output[i:i + n]) == marker:
                    start = i + n
                    break
            searched = len(output)
        self._starts[request.request_id] = (searched, start)
        return start

    def _synced(self, requests: list[Request], starts: list[int]) -> list[_Matcher]:
        """Each request's matcher, having accepted exactly the request's output tokens from its
        grammar's start. The usual step (one new token per matcher) is accepted in one batched call."""
        import xgrammar as xgr

        outputs = [r.output_token_ids[start:] for r, start in zip(requests, starts)]
        states = [self._rewound(r, start, len(out)) for r, start, out in zip(requests, starts, outputs)]
        behind = [k for k, s in enumerate(states) if not s.broken and s.num_accepted < len(outputs[k])]
        one_behind = [k for k in behind if states[k].num_accepted == len(outputs[k]) - 1
                      and not states[k].matcher.is_terminated()]
        if len(one_behind) > 1:
            accepted = xgr.BatchGrammarMatcher.batch_accept_token([states[k].matcher for k in one_behind],
                                                                  [outputs[k][-1] for k in one_behind])
            for k, ok in zip(one_behind, accepted):
                self._accepted(states[k], outputs[k][-1], ok, requests[k].request_id)
        for k in behind:
            state, output = states[k], outputs[k]
            while state.num_accepted < len(output) and not state.broken:
                token = output[state.num_accepted]
                ok = not state.matcher.is_terminated() and state.matcher.accept_token(token)
                self._accepted(state, token, ok, requests[k].request_id)
        return states

    @staticmethod
    def _accepted(state: _Matcher, token: int, ok: bool, request_id: str) -> None:
        if not ok:
            logger.warning("request %s: its grammar refused token %d; the rest of its output is "
                           "unconstrained", request_id, token)
            state.broken = True
        state.num_accepted += 1

    def _rewound(self, request: Request, start: int, num_tokens: int) -> _Matcher:
        """The request's matcher (made on first use, or again when its grammar's start moved),
        rolled back to at most the ``num_tokens`` output tokens from ``start``."""
        import xgrammar as xgr

        state = self._matchers.get(request.request_id)
        if state is not None and state.start != start:
            state = None
        if state is not None and state.num_accepted > num_tokens:
            rewind = state.num_accepted - num_tokens
            if not state.broken:  # xgrammar keeps every step, so any rewind is a rollback
                state.matcher.rollback(rewind)
                state.num_accepted = num_tokens
            else:
                state = None
        if state is None:
            grammar = self.compiler.compile(request.sampling_params.structured_outputs)
            state = _Matcher(xgr.GrammarMatcher(grammar, override_stop_tokens=self.compiler.stop_token_ids), start)
            self._matchers[request.request_id] = state
        return state
