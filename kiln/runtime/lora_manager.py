"""``LoraManager``: a model runner's LoRA adapters, on the host and in the model's device slots.

    LoRARequest ──add──> host: read and checked once (kiln.models.lora.read_adapter), kept in an
                         LRU of lora.max_cpu_loras (an evicted one is read again from its path)
    each step    ──────> device: every adapter of the step in one of lora.max_loras slots (1..S),
                         a slot not used by this step reused least recently used first; the
                         step's token slots (0: the base model) go to the input buffers

Rules kept here:
- One id names one adapter directory for the manager's life (``add`` refuses another path under a
  known id, even after ``remove``): blocks of the prefix cache are keyed by the id.
- A step never holds more distinct adapters than slots (the scheduler's ``max_loras``), so the
  slots it needs are all written before its forward; slots are written in place between steps
  (the stream orders the copies after the step before).
- ``add`` leaves nothing behind when the adapter is refused.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Iterable, Optional

import torch
from torch import nn

from kiln.config import LoraConfig
from kiln.lora_request import LoRARequest
from kiln.models.lora import LoraAdapter, attach_lora, read_adapter
from kiln.ops.options import current
from kiln.runtime.request import Request

logger = logging.getLogger(__name__)


class LoraManager:
    def __init__(self, model: nn.Module, config: LoraConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.dtype = dtype
        # CUDA: the shrink joins the base GEMM (kiln.models.lora's joined layout, LoraShrinkJoinPass);
        # kernels.lora_join=false keeps the stacks apart, to measure against.
        join = torch.device(device).type == "cuda" and current().lora_join
        self.loras = attach_lora(model, config.max_loras, config.max_lora_rank, dtype, device, join_shrink=join)
        self._paths: dict[int, str] = {}  # every id ever added -> its directory
        self._names: dict[int, str] = {}  # ids added and not removed -> name
        self._host: OrderedDict[int, LoraAdapter] = OrderedDict()  # least recently used first
        self._slot_of: dict[int, int] = {}  # id -> device slot (1..max_loras)
        self._slot_lru: OrderedDict[int, int] = OrderedDict()  # slot -> id, least recently used first
        self.num_slot_writes = 0

    # ---- adapters -------------------------------------------------------------------------------
    def add(self, lora: LoRARequest) -> bool:
        """Read and check ``lora`` onto the host (ValueError naming the file and field); False when
        it was known already."""
        known = self._paths.get(lora.lora_int_id)
        if known is not None and known != lora.lora_path:
            raise ValueError(f"lora_int_id {lora.lora_int_id} names adapter directory {known!r} already; "
                             f"give {lora.lora_path!r} an id of its own")
        if lora.lora_int_id in self._names and lora.lora_int_id in self._host:
            self._host.move_to_end(lora.lora_int_id)
            return False
        self._load(lora)
        self._paths[lora.lora_int_id] = lora.lora_path
        self._names[lora.lora_int_id] = lora.lora_name
        return True

    def remove(self, lora_id: int) -> bool:
        """Forget adapter ``lora_id`` on the host and in its slot; False when it was not loaded."""
        self._host.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._slot_lru.pop(slot, None)
        return self._names.pop(lora_id, None) is not None

    def list(self) -> dict[int, str]:
        return dict(self._names)

    def _load(self, lora: LoRARequest) -> LoraAdapter:
        adapter = read_adapter(lora.lora_name, lora.lora_path, self.loras.shapes, self.loras.num_layers,
                               self.config.max_lora_rank, self.dtype)
        self._host[lora.lora_int_id] = adapter
        while len(self._host) > self.config.num_cpu_loras:
            dropped, _ = self._host.popitem(last=False)
            logger.debug("LoRA adapter %d dropped from the host cache (lora.max_cpu_loras)", dropped)
        return adapter

    def _host_adapter(self, lora: LoRARequest) -> LoraAdapter:
        adapter = self._host.get(lora.lora_int_id)
        if adapter is None:
            return self._load(lora)
        self._host.move_to_end(lora.lora_int_id)
        return adapter

    # ---- one step -------------------------------------------------------------------------------
    def token_slots(self, requests: Iterable[Request]) -> list[int]:
        """The device slot of each request (0: the base model), after writing every adapter the
        step needs into a slot."""
        requests = list(requests)
        wanted = {r.lora_id: r.lora_request for r in requests if r.lora_id}
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step of {len(wanted)} adapters exceeds lora.max_loras={self.config.max_loras}")
        for lora_id, lora in wanted.items():
            slot = self._slot_of.get(lora_id)
            if slot is None:
                slot = self._free_slot(set(wanted))
                self.loras.write(slot - 1, self._host_adapter(lora))
                self.num_slot_writes += 1
                self._slot_of[lora_id] = slot
            self._slot_lru.pop(slot, None)
            self._slot_lru[slot] = lora_id
        return [self._slot_of[r.lora_id] if r.lora_id else 0 for r in requests]

    def _free_slot(self, in_step: set[int]) -> int:
        for slot in range(1, self.config.max_loras + 1):
            if slot not in self._slot_lru:
                return slot
        for slot, lora_id in self._slot_lru.items():  # least recently used first
            if lora_id not in in_step:
                del self._slot_lru[slot]
                self._slot_of.pop(lora_id, None)
                return slot
        raise RuntimeError("no LoRA slot is free")  # unreachable: the step fits the slots

    def slot_of(self, lora_id: int) -> Optional[int]:
        return self._slot_of.get(lora_id)
