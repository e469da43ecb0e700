"""Steps sent to tensor-parallel ranks as deltas: a rank's mirror rebuilds exactly the scheduler's
output, through appends, chunked prefill, preemption and forgetting, and a steady decode is small."""

import pickle
import random

import pytest

from kiln.runtime.request import Request
from kiln.runtime.scheduler_output import ScheduledRequest, SchedulerOutput
from kiln.runtime.step_delta import NewRequest, RequestMirror, StepDelta, StepEncoder
from kiln.sampling_params import SamplingParams


def _view(sched: SchedulerOutput):
    """What the model runner reads of a step."""
    return [(s.request.request_id, s.start, s.num_new_tokens, list(s.block_ids),
             s.request.token_ids_slice(s.start, s.start + s.num_new_tokens), s.samples,
             s.request.output_token_ids, s.request.sampling_params) for s in sched.scheduled]


class _Sim:
    """A toy engine: requests grow by one token and one block every few steps."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.requests: dict[str, tuple[Request, list[int]]] = {}
        self.next_block = 1

    def add(self, rid: str, prompt_len: int) -> None:
        req = Request(rid, [self.rng.randrange(1000) for _ in range(prompt_len)],
                      SamplingParams(temperature=self.rng.random(), seed=self.rng.randrange(100)))
        self.requests[rid] = (req, [])

    def step(self, chunk: int = 5) -> SchedulerOutput:
        out = SchedulerOutput()
        for req, blocks in self.requests.values():
            n = min(chunk, req.num_tokens - req.num_computed_tokens)
            while len(blocks) * 4 < req.num_computed_tokens + n:
                blocks.append(self.next_block)
                self.next_block += 1
            out.scheduled.append(ScheduledRequest(req, n, list(blocks)))
        return out

    def finish_step(self, sched: SchedulerOutput) -> None:
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                s.request.output_token_ids.append(self.rng.randrange(1000))


def test_mirror_rebuilds_every_step_through_growth_preemption_and_forget():
    rng = random.Random(0)
    sim, encoder, mirror = _Sim(rng), StepEncoder(), RequestMirror()
    sim.add("a", 11)
    sim.add("b", 3)
    for step in range(30):
        if step == 4:
            sim.add("c", 7)
        if step == 9:  # preempt "a": blocks freed, recomputed from scratch with new blocks
            req, blocks = sim.requests["a"]
            req.num_computed_tokens, blocks[:] = 0, []
            sched = sim.step()
            sched.preempted_ids.append("a")
        else:
            sched = sim.step()
        if step == 15:
            encoder.forget(["b"])
            mirror.forget(["b"])
            del sim.requests["b"]
            sched = sim.step()
        rebuilt = mirror.apply(pickle.loads(pickle.dumps(encoder.encode(sched))))
        assert _view(rebuilt) == _view(sched), f"step {step}"
        assert rebuilt.preempted_ids == sched.preempted_ids
        sim.finish_step(sched)
    assert len(encoder) == len(mirror) == 2


def test_a_shrunken_block_table_travels_in_full():
    sim, encoder, mirror = _Sim(random.Random(1)), StepEncoder(), RequestMirror()
    sim.add("a", 9)
    first = sim.step(chunk=9)
    mirror.apply(encoder.encode(first))
    sim.finish_step(first)
    req, blocks = sim.requests["a"]
    blocks[:] = [50]  # not an extension of what the rank holds
    sched = SchedulerOutput([ScheduledRequest(req, 1, [50])])
    delta = encoder.encode(sched)
    assert isinstance(delta.scheduled[0], NewRequest)
    assert _view(mirror.apply(delta)) == _view(sched)


def test_an_unknown_cached_request_is_a_clear_error():
    with pytest.raises(RuntimeError, match="never received in full"):
        RequestMirror().apply(StepDelta(scheduled=[("x", [1], [], 3, 1)]))


def test_a_steady_decode_step_is_small():
    sim, encoder = _Sim(random.Random(2)), StepEncoder()
    for i in range(64):
        sim.add(f"r{i}", 400)
    sched = sim.step(chunk=400)
    encoder.encode(sched)
    sim.finish_step(sched)
    decode = sim.step()
    full = len(pickle.dumps(decode))
    delta = len(pickle.dumps(encoder.encode(decode)))
    assert delta < 64 * 64  # a few integers per request
    assert delta * 20 < full
