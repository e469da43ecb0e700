"""One-time conversion of a Llama-family GGUF file into a Hugging Face directory.

Layout written under the cache dir (``<key>`` hashes the file's bytes and CONVERTER_VERSION, so a
reinstall or a copy of the same file elsewhere reuses its conversion)::

    <cache_dir>/tokenizers/<name>-<key>/   tokenizer.json, tokenizer_config.json, chat_template.jinja
    <cache_dir>/models/<name>-<key>/       config.json, model.safetensors (float32), the tokenizer files
    <cache_dir>/models/.gguf-keys/<stat>   the <key> of the file whose path, size and mtime hash to <stat>

Rules kept here:
- Every directory is built in a temp dir beside its final place and renamed into place, so a reader
  never sees half a conversion; when two processes race, the first rename wins and the loser's copy
  is dropped.
- Weights are dequantized to float32 (exact for Q4/Q8 blocks) and given Hugging Face names and row
  order: llama.cpp's converter permutes the rows of q/k projections of ``llama`` models to its own
  rotary layout, and that permutation is undone here exactly as transformers' GGUF loader does.
- A model's weights are converted in a child process while this one converts its tokenizer
  (``WeightsConversion``): both are seconds of single-threaded Python, and the tokenizer's import of
  transformers is then done for the start that loads it.
- Bump CONVERTER_VERSION whenever the output changes, so stale conversions are not reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterator, Optional

import numpy as np
import torch

from kiln.models.arch import ArchConfig
from kiln.progress import progress_bar

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def conversion_key(gguf_path: str, cache_dir: str) -> str:
    """12 hex digits of the sha256 of the file's bytes and CONVERTER_VERSION. Hashing reads the whole
    file (0.17 s for SmolLM2's 98 MB on a 2-vCPU EPYC), so the key is remembered under
    ``models/.gguf-keys/`` (hidden: not a cache entry) by the file's real path, size and mtime: a restart only stats the file, and a
    reinstalled package (a new mtime) or a new virtual environment hashes it once and finds the
    conversion it made before."""
    path = os.path.realpath(gguf_path)
    st = os.stat(path)
    stat_key = hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
    memo = os.path.join(cache_dir, "models", ".gguf-keys", stat_key)
    try:
        with open(memo) as f:
            key = f.read().strip()
        if len(key) == 12:
            return key
    except OSError:
        pass
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    digest.update(f":{CONVERTER_VERSION}".encode())
    key = digest.hexdigest()[:12]
    try:  # a read-only cache (one prepared elsewhere) is still used, hashing the file each start
        os.makedirs(os.path.dirname(memo), exist_ok=True)
        tmp = f"{memo}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(key)
        os.replace(tmp, memo)  # readers see the whole key or none
    except OSError:
        pass
    return key


def _model_dir(gguf_path: str, cache_dir: str, name: str) -> str:
    return os.path.join(cache_dir, "models", f"{name}-{conversion_key(gguf_path, cache_dir)}")


def convert_gguf(gguf_path: str, cache_dir: str, name: str) -> str:
    """Path of the converted Hugging Face directory for ``gguf_path``, converting on first use."""
    dest = _model_dir(gguf_path, cache_dir, name)
    if os.path.isdir(dest):
        return dest
    logger.info("kiln: converting %s from GGUF into %s (first start only; later starts reuse it)", name, dest)
    with _staging(dest) as tmp:
        weights = WeightsConversion(gguf_path, tmp, name)
        try:
            tokenizer_dir = convert_gguf_tokenizer(gguf_path, cache_dir, name)  # meanwhile, in this process
            weights.wait()
        finally:
            weights.stop()
        for fname in os.listdir(tokenizer_dir):
            shutil.copy(os.path.join(tokenizer_dir, fname), tmp)
    return dest


def write_weights(gguf_path: str, out_dir: str, name: str) -> None:
    """config.json and model.safetensors (float32, Hugging Face names) of the GGUF, into ``out_dir``."""
    from gguf import GGUFReader
    from safetensors.torch import save_file

    reader = GGUFReader(gguf_path)
    arch = arch_from_gguf(reader)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({**arch.to_hf_config(), "torch_dtype": "float32"}, f, indent=2)
    tensors = progress_bar(iter_hf_tensors(reader, arch), desc=f"converting {name}", total=len(reader.tensors),
                           unit="tensor")
    save_file(dict(tensors), os.path.join(out_dir, "model.safetensors"), {"format": "pt"})


# A ValueError in the child (a GGUF kiln cannot convert) exits with this code, its message written
# to this file in the output directory; any other failure leaves its traceback on the child's stderr.
_CHILD_VALUE_ERROR = 3
_CHILD_ERROR_FILE = ".conversion-error"
_CHILD = f"""
import os, sys
try:
    from kiln.models.gguf import write_weights
    write_weights(*sys.argv[1:4])
except ValueError as e:
    with open(os.path.join(sys.argv[2], {_CHILD_ERROR_FILE!r}), "w") as f:
        f.write(str(e))
    sys.exit({_CHILD_VALUE_ERROR})
"""


class WeightsConversion:
    """``write_weights`` in a child process, beside the tokenizer's conversion in this one: each is
    seconds of single-threaded Python (the gguf reader walks the vocabulary element by element, once
    for each), which one process would run one after the other. With one CPU, or where no child
    process can start, ``wait()`` converts in this process instead. ``wait()`` raises what went wrong
    in the child (a ValueError as such); ``stop()`` ends a child the caller no longer waits for."""

    def __init__(self, gguf_path: str, out_dir: str, name: str) -> None:
        self._args = (gguf_path, out_dir, name)
        self._proc: Optional[subprocess.Popen] = None
        if _num_cpus() < 2 or not sys.executable:
            return
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, *self._args], env=env,
                                          stdin=subprocess.DEVNULL)
        except OSError as e:  # no process to be had: convert here, one after the other
            logger.warning("converting %s's weights in this process: a child process could not start (%s)",
                           name, e)

    def wait(self) -> None:
        if self._proc is None:
            return write_weights(*self._args)
        code = self._proc.wait()
        error_file = os.path.join(self._args[1], _CHILD_ERROR_FILE)
        if code == _CHILD_VALUE_ERROR and os.path.isfile(error_file):
            with open(error_file) as f:
                raise ValueError(f.read())
        if code != 0:
            raise RuntimeError(f"converting the weights of {self._args[0]} failed in a child process (exit code "
                               f"{code}; its error is above)")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def convert_gguf_tokenizer(gguf_path: str, cache_dir: str, name: str) -> str:
    """A directory with the GGUF's tokenizer (chat template included): the converted model's when it
    exists, else a tokenizer-only conversion (seconds, not the weights' tens of seconds)."""
    model_dir = _model_dir(gguf_path, cache_dir, name)
    if os.path.isdir(model_dir):
        return model_dir
    dest = os.path.join(cache_dir, "tokenizers", f"{name}-{conversion_key(gguf_path, cache_dir)}")
    if os.path.isdir(dest):
        return dest
    with _staging(dest) as tmp:
        from kiln.models.hf_generic import import_transformers

        import_transformers()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        if not tokenizer.chat_template:
            raise ValueError(f"{gguf_path} has no chat template; kiln needs one for chat requests")
        tokenizer.save_pretrained(tmp)
    return dest


def _num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def _staging(dest: str) -> Iterator[str]:
    """A temp dir beside ``dest``, renamed to ``dest`` on success and removed in every case."""
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.", dir=parent)
    try:
        yield tmp
        try:
            os.rename(tmp, dest)
        except OSError:
            if not os.path.isdir(dest):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32_decimal(x: float) -> float:
    # GGUF stores floats as float32 (1e-5 reads back as 9.9999997e-06); keep the shortest decimal.
    return float(f"{x:.7g}")


def arch_from_gguf(reader: Any) -> ArchConfig:
    """ArchConfig from the GGUF metadata (``<arch>.*`` and ``tokenizer.ggml.*`` keys)."""
    family = _field(reader, "general.architecture")
    if family not in ("llama", "qwen2"):
        raise ValueError(f"GGUF architecture {family!r} is not supported; kiln converts 'llama' and 'qwen2'")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 rope scaling) are not supported")
    hidden = int(_field(reader, f"{family}.embedding_length"))
    num_heads = int(_field(reader, f"{family}.attention.head_count"))
    head_dim = int(_field(reader, f"{family}.attention.key_length", hidden // num_heads))
    rope_dim = int(_field(reader, f"{family}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head_dim {head_dim}) are not supported")
    vocab = _field(reader, f"{family}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ArchConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{family}.feed_forward_length")),
        num_layers=int(_field(reader, f"{family}.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{family}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, f"{family}.context_length")),
        rms_norm_eps=_f32_decimal(_field(reader, f"{family}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32_decimal(_field(reader, f"{family}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        family=family,
    )


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, suffix = gguf_name.rsplit(".", 1)
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to kiln")


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation; ``num_heads`` is the head count of that projection.

    Per head, llama.cpp reorders rows from [2, head_dim/2] (HF's rotate-half halves) to
    [head_dim/2, 2] (interleaved pairs); this swaps them back.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_hf_tensors(reader: Any, arch: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the GGUF file, dequantized."""
    from gguf.quants import dequantize

    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        if arch.family == "llama" and ".attn_q." in t.name:
            w = unpermute_rotary_rows(w, arch.num_heads)
        elif arch.family == "llama" and ".attn_k." in t.name:
            w = unpermute_rotary_rows(w, arch.num_kv_heads)
        yield hf_tensor_name(t.name), torch.from_numpy(np.ascontiguousarray(w).copy())
