"""The threaded safetensors reader gives the same tensors as the safetensors library."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.models import weight_reader
from kiln.models.weight_reader import iter_files_to_device, read_header
from tests.helpers.paths import REPO


def _random_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.randn(37, 129, generator=gen).to(torch.bfloat16),  # several chunks when chunks are small
        "b.bias": torch.randn(5, generator=gen),
        "c.ids": torch.randint(-1000, 1000, (3, 4, 5), generator=gen, dtype=torch.int64),
        "d.empty": torch.empty(0, 7),
        "e.scale": torch.randn((), generator=gen, dtype=torch.float64),
        "f.fp8": torch.randn(16, 8, generator=gen).to(torch.float8_e4m3fn),
        "g.half": torch.randn(300, generator=gen).half(),
    }


@pytest.mark.parametrize("chunk_bytes,num_buffers", [(64, 2), (1000, 3), (1 << 20, 16)])
def test_reader_matches_safetensors(tmp_path, monkeypatch, chunk_bytes, num_buffers):
    monkeypatch.setattr(weight_reader, "CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(weight_reader, "NUM_BUFFERS", num_buffers)
    gen = torch.Generator().manual_seed(chunk_bytes)
    files = []
    for i in range(2):
        tensors = {f"s{i}.{k}": v for k, v in _random_tensors(gen).items()}
        path = str(tmp_path / f"shard{i}.safetensors")
        save_file(tensors, path, metadata={"format": "pt"})
        files.append(path)
    expected = {k: v for path in files for k, v in load_file(path).items()}
    got = dict(iter_files_to_device(files, torch.device("cpu")))
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


def test_reader_yields_in_storage_order_and_stops_early(tmp_path):
    path = str(tmp_path / "m.safetensors")
    save_file(_random_tensors(torch.Generator().manual_seed(1)), path)
    names = [e.name for e in read_header(path)]
    starts = [e.start for e in read_header(path)]
    assert starts == sorted(starts)
    reader = iter_files_to_device([path], torch.device("cpu"))
    first = next(reader)
    assert first[0] == names[0]
    reader.close()  # leaves no read running on a closed file


def test_reader_names_a_truncated_file(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file(_random_tensors(torch.Generator().manual_seed(3)), str(path))
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(OSError, match="m.safetensors.*shorter than its safetensors header"):
        list(iter_files_to_device([str(path)], torch.device("cpu")))


def test_reader_refuses_a_file_that_is_not_safetensors(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        list(iter_files_to_device([str(path)], torch.device("cpu")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reader_to_gpu_matches_safetensors(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_reader, "CHUNK_BYTES", 4096)
    path = str(tmp_path / "m.safetensors")
    tensors = _random_tensors(torch.Generator().manual_seed(2))
    tensors["big"] = torch.randn(1000, 333)
    save_file(tensors, path)
    for name, t in iter_files_to_device([path], torch.device("cuda")):
        assert t.is_cuda
        assert torch.equal(t.cpu().reshape(-1).view(torch.uint8), tensors[name].reshape(-1).view(torch.uint8)), name


def _checkpoint(tmp_path):
    from benchmarks.startup.starts import write_checkpoint

    return write_checkpoint("tiny", tmp_path / "ckpt")


def test_cpu_reads_into_place_what_fits_and_maps_the_rest(tmp_path):
    from kiln.models.weight_reader import iter_file_into

    path = str(tmp_path / "m.safetensors")
    tensors = _random_tensors(torch.Generator().manual_seed(5))
    save_file(tensors, path)
    dests = {name: torch.full_like(t, 7) for name, t in tensors.items() if name != "c.ids"}
    dests["g.half"] = torch.zeros(300, dtype=torch.float32)  # another dtype: given mapped, left alone
    dests["a.weight"] = torch.zeros(37, 2 * 129, dtype=torch.bfloat16)[:, :129]  # not contiguous: the same
    got = dict(iter_file_into(path, dests))
    assert list(got) == [e.name for e in read_header(path)]
    for name, want in tensors.items():
        placed = name in ("b.bias", "d.empty", "e.scale", "f.fp8")
        assert (got[name] is None) == placed, name
        have = dests[name] if placed else got[name]
        assert have.dtype == want.dtype and torch.equal(have.reshape(-1).view(torch.uint8),
                                                        want.reshape(-1).view(torch.uint8)), name
    assert not dests["g.half"].any() and not dests["a.weight"].any()


def test_cpu_read_into_place_falls_back_to_mapping_without_preadv(tmp_path, monkeypatch):
    from kiln.models.weight_reader import iter_file_into

    path = str(tmp_path / "m.safetensors")
    tensors = _random_tensors(torch.Generator().manual_seed(6))
    save_file(tensors, path)
    monkeypatch.delattr("os.preadv")
    got = dict(iter_file_into(path, {name: torch.empty_like(t) for name, t in tensors.items()}))
    assert all(got[name] is not None and torch.equal(got[name].reshape(-1).view(torch.uint8),
                                                     t.reshape(-1).view(torch.uint8)) for name, t in tensors.items())


def test_cpu_load_reads_the_checkpoint_into_the_parameters(tmp_path, monkeypatch):
    """Every tensor of a checkpoint in the model's dtype is read into place (the fused q/k/v and
    gate/up parameters take several), and the model holds what copying each tensor in gives."""
    import json

    from kiln.config import ModelConfig
    from kiln.models import loader, weight_reader
    from kiln.models.arch import ArchConfig

    ckpt = _checkpoint(tmp_path)
    placed = []
    read_into = weight_reader._read_into
    monkeypatch.setattr(weight_reader, "_read_into", lambda fd, buf, at: placed.append(at) or read_into(fd, buf, at))
    model = loader.load_model(ModelConfig(model=str(ckpt)), str(tmp_path / "cache"), torch.device("cpu"),
                              torch.bfloat16).model
    assert len(placed) == loader._num_tensors(str(ckpt))
    arch = ArchConfig.from_hf_config(json.loads((ckpt / "config.json").read_text()))
    want = loader.build_empty_model(arch, torch.device("cpu"), torch.bfloat16)
    want.load_weights(item for f in loader._safetensors_files(str(ckpt)) for item in load_file(str(ckpt / f)).items())
    assert list(model.state_dict()) == list(want.state_dict())
    for (name, got), t in zip(model.state_dict().items(), want.state_dict().values()):
        assert torch.equal(got, t), name


@pytest.mark.parametrize("damage,message", [
    ("truncate", "model-00001-of-00001.safetensors' is not a readable safetensors file .*fetch it again"),
    ("garbage", "model-00001-of-00001.safetensors' is not a readable safetensors file"),
    ("lose_shard", "lacks 1 of the weight files its index names \\(model-00001-of-00001.safetensors\\)"),
    ("bad_index", "model.safetensors.index.json' is not a safetensors index"),
    ("cut_config", "config.json' is not valid JSON .*fetch it again"),
    ("thin_config", "config.json' does not describe a llama model kiln can build: KeyError"),
    ("bad_tokenizer", "cannot build the tokenizer of .*are its tokenizer files complete"),
])
def test_a_damaged_checkpoint_is_a_value_error_naming_the_file(tmp_path, damage, message):
    """What an interrupted download leaves is refused with the file named and what to do (the
    command line prints a ValueError's first line), before any weight is read; a config.json without
    the fields kiln reads, too."""
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model

    ckpt = _checkpoint(tmp_path)
    shard = ckpt / "model-00001-of-00001.safetensors"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "garbage":
        shard.write_bytes(b"not a safetensors file")
    elif damage == "lose_shard":
        shard.unlink()
    elif damage == "bad_index":
        (ckpt / "model.safetensors.index.json").write_text('{"weight_map": [')
    elif damage == "cut_config":
        (ckpt / "config.json").write_text((ckpt / "config.json").read_text()[:20])
    elif damage == "thin_config":
        (ckpt / "config.json").write_text('{"model_type": "llama"}')
    else:
        (ckpt / "tokenizer.json").write_text((ckpt / "tokenizer.json").read_text()[:1000])
    with pytest.raises(ValueError, match=message):
        load_model(ModelConfig(model=str(ckpt)), str(tmp_path / "cache"), torch.device("cpu"), torch.float32)


def test_background_load_is_synchronous_off_the_gpu(tmp_path):
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model

    ckpt = _checkpoint(tmp_path)
    loaded = load_model(ModelConfig(model=str(ckpt)), str(tmp_path / "cache"), torch.device("cpu"), torch.float32,
                        background=True)
    assert loaded.filling is None and loaded.wait_for_weights() == 0.0
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    tokenizer = loaded.wait_for_tokenizer()  # built on a thread meanwhile
    assert loaded.tokenizing is None and tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"


def test_tokenizer_is_the_one_auto_tokenizer_builds(tmp_path):
    import json

    from transformers import AutoTokenizer

    from kiln.models.loader import _generic_fast_tokenizer, _load_tokenizer

    ckpt = _checkpoint(tmp_path)
    assert _generic_fast_tokenizer(str(ckpt))
    ours, auto = _load_tokenizer(str(ckpt)), AutoTokenizer.from_pretrained(str(ckpt))
    assert type(ours) is type(auto) and len(ours) == len(auto)
    assert (ours.bos_token_id, ours.eos_token_id) == (auto.bos_token_id, auto.eos_token_id)
    text = "Hello <|im_start|> wörld, 12345\n\tdone"
    ids = auto.encode(text)
    assert ours.encode(text) == ids and ours.decode(ids) == auto.decode(ids)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)
    # Another class, or a model type whose tokenizer AutoTokenizer may swap: AutoTokenizer decides.
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    assert not _generic_fast_tokenizer(str(ckpt))
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    model_config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**model_config, "model_type": "qwen2"}))
    assert not _generic_fast_tokenizer(str(ckpt))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_background_load_gives_the_same_weights(tmp_path):
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model

    ckpt = _checkpoint(tmp_path)
    args = (ModelConfig(model=str(ckpt)), str(tmp_path / "cache"), torch.device("cuda"), torch.bfloat16)
    plain = load_model(*args).model.state_dict()
    loaded = load_model(*args, background=True)
    assert loaded.filling is not None
    assert loaded.wait_for_weights() > 0 and loaded.filling is None
    got = loaded.model.state_dict()
    assert set(got) == set(plain)
    for name, t in plain.items():
        assert torch.equal(got[name], t), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_background_load_reraises_what_went_wrong(tmp_path):
    from kiln.config import ModelConfig
    from kiln.models.loader import load_model

    ckpt = _checkpoint(tmp_path)
    shard = next(ckpt.glob("*.safetensors"))
    tensors = load_file(str(shard))
    del tensors["model.norm.weight"]  # a checkpoint that lacks a weight
    save_file(tensors, str(shard))
    loaded = load_model(ModelConfig(model=str(ckpt)), str(tmp_path / "cache"), torch.device("cuda"), torch.bfloat16,
                        background=True)
    with pytest.raises(ValueError, match="checkpoint lacks 1 weight.*model.norm.weight"):
        loaded.wait_for_weights()


def test_quick_gil_handoff_holds_the_short_interval_until_its_last_user_leaves():
    """The weight read and a background build overlap on a first CUDA start: whichever ends first
    must not give the other Python's 5 ms interval back."""
    import sys

    from kiln.models.loader import QUICK_SWITCH_INTERVAL_S, quick_gil_handoff

    before = sys.getswitchinterval()
    assert before > QUICK_SWITCH_INTERVAL_S
    first, second = quick_gil_handoff(), quick_gil_handoff()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(QUICK_SWITCH_INTERVAL_S)
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(before)


def test_read_ahead_yields_the_source_in_order_and_holds_at_most_its_budget_ahead():
    from kiln.models.weight_reader import ReadAhead

    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    tensors = [(f"t{i}", torch.randn(int(torch.randint(1, 64, (), generator=gen)), generator=gen)) for i in range(40)]
    drawn = []

    def source():
        for name, t in tensors:
            drawn.append(name)
            yield name, t

    budget = 3 * 64 * 4  # three of the largest tensors
    ahead = ReadAhead(source(), budget, torch.device("cpu"))
    import time

    time.sleep(0.2)  # the thread reads ahead as far as the budget lets it
    held = sum(t.numel() * 4 for _, t in tensors[:len(drawn) - 1])
    assert 1 <= len(drawn) < len(tensors) and held <= budget, (len(drawn), held)
    got = list(ahead)
    assert [n for n, _ in got] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, tensors))
    ahead.close()


def test_read_ahead_hands_an_error_over_after_the_tensors_before_it_and_close_stops_the_source():
    from kiln.models.weight_reader import ReadAhead

    closed = []

    def failing():
        try:
            for i in range(3):
                yield f"t{i}", torch.full((4,), float(i))
            raise OSError("the file is shorter than its header says")
        finally:
            closed.append("failing")

    ahead = ReadAhead(failing(), 1 << 20, torch.device("cpu"))
    names = []
    with pytest.raises(OSError, match="shorter"):
        for name, _ in ahead:
            names.append(name)
    assert names == ["t0", "t1", "t2"] and closed == ["failing"]

    def endless():
        try:
            i = 0
            while True:
                yield f"t{i}", torch.zeros(16)
                i += 1
        finally:
            closed.append("endless")

    ahead = ReadAhead(endless(), 64, torch.device("cpu"))  # one tensor ahead, then it waits
    assert next(ahead)[0] == "t0"
    ahead.close()  # a consumer that stops early (a weight that does not fit)
    assert closed == ["failing", "endless"] and list(ahead) == []


def test_tokenizers_loaded_on_several_threads_at_once_all_load():
    """A start's tokenizer is built on a thread; a start that failed can leave that thread importing
    transformers while a retried start builds its own. In a fresh interpreter (transformers not yet
    imported) four threads build the embedded model's tokenizer at once: without import_transformers
    some failed with "cannot import name 'PreTrainedTokenizerFast'"."""
    import os
    import subprocess
    import sys

    code = """
import os, threading
from kiln.models.loader import _load_tokenizer, tokenizer_dir
path = tokenizer_dir(os.environ["KILN_CACHE_DIR"])
errors = []
def load():
    try:
        assert _load_tokenizer(path).encode("hello")
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=load) for _ in range(3)]
for t in threads:
    t.start()
load()
for t in threads:
    t.join()
print("ERRORS", errors)
"""
    repo = str(REPO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERRORS []" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_a_failed_start_stops_its_weight_fill_and_the_read_behind_it():
    """``LoadedModel.cancel_fill`` (a start-up that failed while the weights were read): the fill
    stops at its next tensor, the read-ahead's source is closed, nothing more is drawn, and what
    the fill raised is not re-raised on the caller's thread."""
    import threading
    import time

    from kiln.models.loader import LoadedModel, WeightFill, _load_then_close
    from kiln.models.weight_reader import ReadAhead

    drawn, closed, copied = [], [], []
    first = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                drawn.append(i)
                yield f"t{i}", torch.full((4,), float(i))
                i += 1
                time.sleep(0.005)
        finally:
            closed.append(True)

    class Model:
        def load_weights(self, weights):
            for name, tensor in weights:
                copied.append(name)
                first.set()

    source = ReadAhead(endless(), 64, torch.device("cpu"))
    loaded = LoadedModel(Model(), None, None, "m", None, 16, filling=WeightFill(
        lambda fill: _load_then_close(Model(), fill.tensors(source), source), torch.device("cpu")))
    assert first.wait(5)
    loaded.cancel_fill(timeout=5)
    assert loaded.filling is None and closed == [True]
    num_drawn, num_copied = len(drawn), len(copied)
    time.sleep(0.05)
    assert len(drawn) == num_drawn and len(copied) == num_copied >= 1
    assert loaded.wait_for_weights() == 0.0  # nothing in flight any more


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_start_that_fails_during_the_read_leaves_no_reading_thread(tmp_path, monkeypatch):
    """A CUDA start from a checkpoint (a slow read: 0.2 s a tensor) that fails before it waits for
    the weights: the fill and read-ahead threads end with it, not once the whole checkpoint is read."""
    import threading
    import time

    from kiln import LLM
    from kiln.models import loader
    from kiln.runtime import model_runner

    ckpt = _checkpoint(tmp_path)
    real = loader.iter_safetensors
    read = []

    def slow(hf_dir, device="cpu"):
        for item in real(hf_dir, device):
            time.sleep(0.2)
            read.append(item[0])
            yield item

    def fail(*args, **kwargs):
        raise RuntimeError("a failure while the weights are read")

    monkeypatch.setattr(loader, "iter_safetensors", slow)
    monkeypatch.setattr(model_runner, "forward_profile_key", fail)
    with pytest.raises(RuntimeError, match="while the weights are read"):
        LLM(model=str(ckpt), device="cuda", cache={"dir": str(tmp_path / "cache")},
            compile={"mode": "kiln", "startup": "fast"})
    readers = [t.name for t in threading.enumerate() if t.name in ("kiln-load-weights", "kiln-read-ahead")]
    num_read = len(read)
    time.sleep(0.5)
    assert not readers and len(read) == num_read < sum(1 for _ in real(str(ckpt))), (readers, num_read)
