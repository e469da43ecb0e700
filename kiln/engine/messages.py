"""The typed messages between a frontend and the engine-core process, encoded with msgspec (msgpack).

    frontend ──► engine core   AddRequest | AbortRequests | LoadLora | UnloadLora | Shutdown
    frontend ◄── engine core   Ready | StartFailed | StepOutputs | Stopped     (one PUSH/PULL pair)

Rules:
- No pickle on the hot path. ``Ready`` alone carries a pickled tokenizer (once per start, so the
  frontend tokenizes exactly as the engine does without loading the model's files itself), and a
  vision model's pickled processor. A request's images travel as their pixel tensors' bytes
  (``ImageFeature``).
- ``StepOutputs.outputs`` are ``RequestDelta``s: what is new since that request's last output
  (``OutputProcessor(delta=True)``), without the prompt (the frontend has it).
- Every message is a tagged ``msgspec.Struct``, so one decoder per direction reads them all.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from kiln.lora_request import LoRARequest
from kiln.outputs import RequestDelta
from kiln.runtime.engine import StartupReport
from kiln.runtime.multimodal import ImageFeature
from kiln.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    """A request the frontend has tokenized and checked (``InputProcessor``)."""

    request_id: str
    prompt: Optional[str]  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    pooling: Optional[str] = None  # "last" | "mean": an embedding request
    lora_request: Optional[LoRARequest] = None  # the adapter it runs with
    mm_features: list[ImageFeature] = []  # its images, placeholders expanded in prompt_token_ids


class LoadLora(msgspec.Struct, tag=True):
    """Read and check an adapter now; answered like an AddRequest (taken or refused) under ``op_id``."""

    op_id: str
    lora: LoRARequest


class UnloadLora(msgspec.Struct, tag=True):
    op_id: str
    lora_int_id: int


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    """Fail what is unfinished, shut the engine down, answer ``Stopped`` and exit."""


class Ready(msgspec.Struct, tag=True):
    """The engine is built and takes requests."""

    tokenizer_pickle: bytes
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    startup: StartupReport
    processor_pickle: bytes = b""  # a vision model's transformers processor; empty: text only


class StartFailed(msgspec.Struct, tag=True):
    """Building the engine raised; a ValueError says what setting to change."""

    error_type: str
    message: str


class Refusal(msgspec.Struct):
    request_id: str
    bad_input: bool  # a ValueError (HTTP 400), else a kiln failure (500)
    message: str


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[RequestDelta] = []
    accepted: list[str] = []  # requests the engine took since its last message
    refused: list[Refusal] = []
    stats: Optional[dict[str, Any]] = None  # LLMEngine.stats() and compile_building, when sent


class Stopped(msgspec.Struct, tag=True):
    """The engine core is leaving: after a Shutdown, or after a failed step (``error``)."""

    error: Optional[str] = None


ToEngine = Union[AddRequest, AbortRequests, LoadLora, UnloadLora, Shutdown]
FromEngine = Union[Ready, StartFailed, StepOutputs, Stopped]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def to_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToEngine)


def from_engine_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromEngine)
