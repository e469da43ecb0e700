"""The encoder cache: the scheduler's bookkeeping on toy sizes (holds, frees, the per-step budget,
chunks cut before an image that does not fit), prefix-cache keys over image tokens, and on a tiny
LLaVA engine the vision encoder's calls counted: the same image is encoded once and its blocks hit
the prefix cache, a different image does neither, and nothing stays held afterwards."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from kiln.config import SchedulerConfig
from kiln.runtime.encoder_cache import EncoderCacheManager
from kiln.runtime.kv_cache_manager import KVCacheManager
from kiln.runtime.multimodal import ImageFeature
from kiln.runtime.request import Request
from kiln.runtime.scheduler import Scheduler
from tests.helpers.vision import image, tiny_llava_checkpoint

IMG = 99  # the toy placeholder id


def feature(mm_hash: str, offset: int, length: int) -> ImageFeature:
    return ImageFeature(mm_hash, offset, length, {})


def mm_request(request_id: str, prompt_len: int, *features: ImageFeature) -> Request:
    ids = [1 + i % 50 for i in range(prompt_len)]
    for f in features:
        ids[f.offset:f.end] = [IMG] * f.length
    return Request(request_id, ids, SamplingParams(max_tokens=2), mm_features=features)


def make_scheduler(budget: int, cache_tokens: int, max_num_batched_tokens: int = 64, chunked: bool = True):
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                             enable_chunked_prefill=chunked)
    return Scheduler(config, kv, encoder_cache=EncoderCacheManager(cache_tokens, budget)), kv


# ---- the manager --------------------------------------------------------------------------------
def test_manager_shares_entries_and_frees_them_when_nobody_holds_them():
    m = EncoderCacheManager(num_tokens=10, budget=10)
    a, b = feature("a", 0, 4), feature("b", 0, 3)
    m.hold("r1", a)
    m.hold("r2", a)  # the same image: one entry
    m.hold("r2", b)
    assert m.num_free == 3
    assert m.take_step() == ([a, b], [])
    m.release("r1")
    assert m.has("a") and m.num_free == 3  # r2 still holds it
    m.release("r2", "a")
    assert not m.has("a") and m.num_free == 7
    m.release("r2")
    assert m.num_free == 10
    assert m.take_step() == ([], ["a", "b"])


def test_manager_keeps_what_the_runner_still_has_and_never_computes_what_was_dropped():
    m = EncoderCacheManager(num_tokens=10, budget=10)
    a = feature("a", 0, 4)
    m.hold("r1", a)
    m.take_step()
    m.release("r1")  # freed, but the runner has not heard yet
    m.hold("r2", a)
    assert m.take_step() == ([], [])  # kept: neither dropped nor computed again
    m.release("r2")
    m.hold("r3", feature("c", 0, 2))
    m.release("r3")  # held and dropped within one schedule: never computed
    assert m.take_step() == ([], ["a"])
    with pytest.raises(ValueError, match="needs 11"):
        m.hold("r4", feature("big", 0, 11))


# ---- the scheduler ------------------------------------------------------------------------------
def test_step_encodes_within_its_budget_and_cuts_before_the_image_that_does_not_fit():
    scheduler, _ = make_scheduler(budget=6, cache_tokens=16)
    # r1: images at [2, 6) and [8, 12); the budget (6) takes the first only.
    r1 = mm_request("r1", 14, feature("x", 2, 4), feature("y", 8, 4))
    scheduler.add_request(r1)
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [8]  # cut at the second image's first token
    assert [f.mm_hash for f in out.encoder_inputs] == ["x"]
    scheduler.update(out, {})
    assert not scheduler.encoder_cache.has("x")  # its tokens are computed: released
    out = scheduler.schedule()
    assert [s.num_new_tokens for s in out.scheduled] == [6]
    assert [f.mm_hash for f in out.encoder_inputs] == ["y"] and out.freed_encoder_hashes == ["x"]


def test_without_chunked_prefill_a_request_waits_for_room_for_its_images():
    scheduler, _ = make_scheduler(budget=6, cache_tokens=16, chunked=False)
    scheduler.add_request(mm_request("r1", 8, feature("x", 0, 4)))
    scheduler.add_request(mm_request("r2", 8, feature("y", 0, 4)))
    out = scheduler.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["r1"]  # r2's image is over the budget left
    assert [f.mm_hash for f in out.encoder_inputs] == ["x"]


def test_a_chunk_may_end_inside_an_image_whose_embeddings_are_held():
    scheduler, _ = make_scheduler(budget=8, cache_tokens=16, max_num_batched_tokens=5)
    r1 = mm_request("r1", 10, feature("x", 2, 6))
    scheduler.add_request(r1)
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 5 and [f.mm_hash for f in out.encoder_inputs] == ["x"]
    scheduler.update(out, {})
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 5 and out.encoder_inputs == []
    assert scheduler.encoder_cache.holds("r1", "x")


def test_images_too_large_for_the_cache_are_refused():
    scheduler, _ = make_scheduler(budget=4, cache_tokens=16)
    with pytest.raises(ValueError, match="image of 6 tokens"):
        scheduler.add_request(mm_request("r1", 10, feature("x", 0, 6)))


def test_finish_and_preemption_release_images():
    scheduler, _ = make_scheduler(budget=8, cache_tokens=16, max_num_batched_tokens=4)
    r1 = mm_request("r1", 10, feature("x", 2, 6))
    scheduler.add_request(r1)
    out = scheduler.schedule()
    scheduler.update(out, {})
    assert scheduler.encoder_cache.holds("r1", "x")
    scheduler.finish_request("r1", r1.status.FINISHED_ABORTED)
    assert scheduler.encoder_cache.num_free == 16


def test_block_hashes_key_image_blocks_by_the_image():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    same = [mm_request(f"s{i}", 9, feature("x", 4, 4)) for i in range(2)]
    other = mm_request("o", 9, feature("y", 4, 4))
    text = mm_request("t", 9)
    text.prompt_token_ids[4:8] = [IMG] * 4
    hashes = [kv._hashes(r, 2) for r in (*same, other, text)]
    assert hashes[0] == hashes[1]
    assert hashes[0][0] == hashes[2][0] == hashes[3][0]  # block 0 is text only
    assert len({h[1] for h in hashes[1:]}) == 3  # the image block: per image, and apart from text


# ---- an engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tiny_llava_checkpoint(str(tmp_path_factory.mktemp("llava")))
    engine = LLM(model=path, dtype="float32", compile={"mode": "eager"}, cache={"block_size": 16, "num_blocks": 64})
    yield engine
    engine.engine.shutdown()


# 16 tokens of text (block 0), the image's 16 tokens (block 1), then more text.
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen" \
         "<image> and then some more words so that the last block is text"
PARAMS = SamplingParams(max_tokens=3, temperature=0.0)


def _run(llm, *images):
    runner = llm.engine.executor.runner
    before = runner.encoder_cache.num_encoded
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": [img]}} for img in images], PARAMS,
                        use_tqdm=False)
    return outs, runner.encoder_cache.num_encoded - before


def test_same_image_is_encoded_once_and_hits_the_prefix_cache(llm):
    num_text = len(llm.tokenizer.encode(PROMPT.split("<image>")[0]))
    assert num_text == 16  # block 0 is the text before the image
    first, encoded = _run(llm, image(30, 30, 11))
    assert encoded == 1 and first[0].num_cached_tokens == 0
    again, encoded = _run(llm, image(30, 30, 11))
    assert encoded == 0  # its blocks came from the prefix cache: no vision encoder
    assert again[0].num_cached_tokens >= 32  # the text block and the image block
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    other, encoded = _run(llm, image(30, 30, 12))
    assert encoded == 1 and other[0].num_cached_tokens == 16  # the text block only


def test_two_requests_with_one_new_image_encode_it_once(llm):
    outs, encoded = _run(llm, image(20, 40, 13), image(20, 40, 13))
    assert encoded == 1
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    cache = llm.engine.scheduler.encoder_cache
    assert cache.num_free == cache.num_tokens  # nothing held once they finished
