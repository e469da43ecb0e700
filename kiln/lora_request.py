"""``LoRARequest``: which adapter a request runs with, as vLLM's ``vllm.lora.request.LoRARequest``.

``lora_int_id`` (>= 1) is the adapter's identity everywhere below the API: the scheduler counts
distinct ids against ``lora.max_loras``, the prefix cache keys blocks by it (two adapters never
share KV) and the model runner's slots hold adapters by it. One id names one adapter directory
for the engine's life: asking for another path under a known id is refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name is empty")
        if not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path is empty")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
