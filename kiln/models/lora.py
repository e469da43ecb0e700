"""LoRA adapters of a native model: PEFT directories read into host tensors, and the device slots
the model's targeted linears compute them from.

Reading (``read_adapter``): a PEFT LoRA directory holds ``adapter_config.json`` (``r``,
``lora_alpha``, ``use_rslora``, ``target_modules``, ``rank_pattern``, ``alpha_pattern``) and
``adapter_model.safetensors`` (``base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight``
of shape [r, in] and ``lora_B.weight`` of shape [out, r]). Each module's scaling (``alpha / r``,
rsLoRA's ``alpha / sqrt(r)``) is folded into its B, which is kept transposed ([r, out]) in the
model dtype. Targets are the attention and MLP projections (q/k/v/o, gate/up/down); an adapter
for the embedding or the LM head, DoRA, trained biases or ``modules_to_save`` is refused, as is a
rank above ``lora.max_lora_rank`` or a tensor whose shape does not fit the base model: every
refusal is a ValueError naming the file and the field, raised before anything is kept.

Computing (``attach_lora``): each decoder layer gets a ``LoraStack`` per fused linear (qkv_proj,
o_proj, gate_up_proj, down_proj) holding every device slot's adapter, laid out so that one
``kiln.add_lora`` serves the fused projection::

    qkv_proj, R = max_lora_rank, slot s:
      lora_a[s]  [3R, hidden]       rows 0..r: q's A, R..R+r: k's A, 2R..2R+r: v's A (zeros past r)
      lora_b[s]  [3R, q + 2 kv]     q's B.T at rows 0..r, cols 0..q; k's at R.., q..q+kv; v's at 2R.., q+kv..

An adapter that leaves a module out leaves its rows zero. Slots are written in place (the
buffers are graph inputs), so which adapter a slot holds is data to the compiled graph. Under
tensor parallelism each rank reads the whole adapter and writes its shard (``module_shards``):
column-parallel projections take their columns of B, row-parallel ones their columns of A.

On the generic path (``GenericLoras``) transformers' own projections are plain linears named as
PEFT names them; each is followed by a stack of one slice (``_LinearWithLora``).

Joined layout (``join_shrink``, on CUDA): a plain linear of the model dtype without a bias gets
its weight moved to the head of a buffer whose tail is the stack's ``lora_a``, so that one GEMM
over the whole buffer computes the base output and every slot's shrink (``LoraShrinkJoinPass``);
the model's forward is unchanged, and ``lora_a`` is still [S, slices * R, in]::

    buffer  rows 0..out: W (linear.weight, a view)   rows out..: A[0], A[1], ... A[S-1] (lora_a, a view)

The weights must be in place before (a background read is waited for): the move copies them.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

import kiln.ops.lora  # noqa: F401  (registers torch.ops.kiln.add_lora)
from kiln.models.parallel import SINGLE, Shard, column_shard, head_shards, row_shard

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
# target -> (the fused linear's stack, which slice of it)
FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
         "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
NOT_SERVED = ("embed_tokens", "lm_head")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraAdapter:
    """One adapter on the host: per (layer, target) its A [r, in] and scaled B.T [r, out]."""

    name: str
    path: str
    rank: int  # the largest module rank
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """target -> (in, out) of one layer's whole projection in ``model`` (a native Llama-family
    model), as the checkpoint and its adapters hold it, whatever this rank's shard; the attention
    projections alone where the MLP layers are sparse (MoE)."""
    arch = model.arch
    h, q, kv = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if any(not hasattr(layer.mlp, "down_proj") for layer in model.layers):  # sparse (MoE) layers
        return shapes  # adapters on the attention projections only
    inter = arch.intermediate_size
    return {**shapes, "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def module_shards(model: nn.Module) -> dict[str, Shard]:
    """target -> the slice of its [out, in] weight this rank holds under tensor parallelism (None:
    all of it), as ``kiln.models.parallel`` shards the base weights. A column-parallel projection's
    adapter keeps A whole and this rank's columns of B.T; a row-parallel one this rank's columns of A
    and B whole: its term joins the partial sum before the block's all-reduce."""
    arch, tp = model.arch, getattr(model, "tp", SINGLE)
    heads = head_shards(arch, tp)
    col, row = column_shard(arch.intermediate_size, tp), row_shard(arch.intermediate_size, tp)
    return {**heads, "o_proj": row_shard(arch.num_heads * arch.head_dim, tp), "gate_proj": col, "up_proj": col,
            "down_proj": row}


def shard_module(pair: tuple[torch.Tensor, torch.Tensor], shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], B.T [r, out]) narrowed to this rank's ``shard`` of the weight [out, in]."""
    if shard is None:
        return pair
    a, bt = pair
    dim, start, length = shard
    return (a, bt.narrow(1, start, length)) if dim == 0 else (a.narrow(1, start, length), bt)


def _local(shape: tuple[int, int], shard: Shard) -> tuple[int, int]:
    fan_in, fan_out = shape
    if shard is None:
        return shape
    return (fan_in, shard[2]) if shard[0] == 0 else (shard[2], fan_out)


def read_adapter(name: str, path: str, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int,
                 dtype: torch.dtype) -> LoraAdapter:
    """The PEFT LoRA adapter in directory ``path``, checked against the base model (``shapes`` from
    ``module_shapes``); ValueError naming the file and field of anything kiln cannot serve."""
    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a directory (a PEFT adapter directory holds "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    for needed in (config_path, weights_path):
        if not os.path.isfile(needed):
            hint = " (only safetensors weights are read; save with safe_serialization=True)" \
                if needed == weights_path and os.path.isfile(os.path.join(path, "adapter_model.bin")) else ""
            raise ValueError(f"LoRA adapter {name!r}: {needed} is missing{hint}")
    config = _read_config(name, config_path, max_rank)
    scaling = _Scaling(config)
    modules: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    from safetensors import safe_open

    try:
        with safe_open(weights_path, framework="pt") as f:
            for key in f.keys():
                layer, target, which = _parse_key(name, weights_path, key, num_layers)
                modules.setdefault((layer, target), {})[which] = f.get_tensor(key)
    except (OSError, RuntimeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} cannot be read: {e}") from e
    adapter = LoraAdapter(name, path, 0)
    for (layer, target), pair in sorted(modules.items()):
        where = f"{weights_path}: model.layers.{layer}.{target}"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"], pair["B"]
        if target not in shapes:
            raise ValueError(f"LoRA adapter {name!r}: {where}: this model's MLP layers are sparse (MoE); kiln "
                             f"serves LoRA on their attention projections ({', '.join(shapes)})")
        fan_in, fan_out = shapes[target]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise ValueError(f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"but the base model's {target} needs [r, {fan_in}] and [{fan_out}, r]: "
                             "an adapter of another base model?")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: {where} has rank {r}, above lora.max_lora_rank={max_rank}; "
                             "raise lora.max_lora_rank")
        scale = scaling.of(f"model.layers.{layer}.{target}", r)
        adapter.modules[(layer, target)] = (a.to(dtype).contiguous(), (b.float().T * scale).to(dtype).contiguous())
        adapter.rank = max(adapter.rank, r)
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds no LoRA weights")
    return adapter


def _read_config(name: str, config_path: str, max_rank: int) -> dict:
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {config_path} is not readable JSON: {e}") from e
    where = f"LoRA adapter {name!r}: {config_path}"
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type is {config.get('peft_type')!r}; kiln serves LORA adapters")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r must be a positive int, got {r!r}")
    ranks = [r, *(v for v in (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise ValueError(f"{where}: r={max(ranks)} is above lora.max_lora_rank={max_rank}; raise lora.max_lora_rank")
    if config.get("use_dora"):
        raise ValueError(f"{where}: use_dora is true; kiln serves plain LoRA (DoRA's magnitude vectors are not applied)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias is {config['bias']!r}; kiln serves adapters without trained biases ('none')")
    if config.get("modules_to_save"):
        raise ValueError(f"{where}: modules_to_save={config['modules_to_save']!r}; kiln serves adapters that replace "
                         "no base module")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{where}: fan_in_fan_out is true; kiln's base linears are not Conv1D")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets == "all-linear" or targets in TARGETS + NOT_SERVED else None
    if targets is not None:  # a regex (a str) is checked through the tensors' names instead
        for t in targets:
            leaf = t.rsplit(".", 1)[-1]
            if leaf in NOT_SERVED:
                raise ValueError(f"{where}: target_modules holds {t!r}; kiln serves LoRA on the attention and MLP "
                                 f"projections ({', '.join(TARGETS)}), not the embedding or LM head")
            if leaf not in TARGETS and t != "all-linear":
                raise ValueError(f"{where}: target_modules holds {t!r}, which is not a projection kiln serves LoRA "
                                 f"on ({', '.join(TARGETS)})")
    return config


def _parse_key(name: str, weights_path: str, key: str, num_layers: int) -> tuple[int, str, str]:
    m = _KEY.match(key)
    if m is None or m.group(2) not in TARGETS:
        leaf = "embedding or LM head " if any(s in key for s in NOT_SERVED + ("lora_embedding",)) else ""
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds {key!r}, a {leaf}tensor kiln cannot serve "
                         f"(LoRA on {', '.join(TARGETS)} only)")
    layer = int(m.group(1))
    if layer >= num_layers:
        raise ValueError(f"LoRA adapter {name!r}: {weights_path} holds {key!r}, but the base model has "
                         f"{num_layers} layers: an adapter of another base model?")
    return layer, m.group(2), m.group(3)


class _Scaling:
    """PEFT's per-module scaling: lora_alpha (or alpha_pattern's) over r (rsLoRA: over sqrt(r))."""

    def __init__(self, config: dict) -> None:
        self.alpha = float(config.get("lora_alpha", config["r"]))
        self.patterns = dict(config.get("alpha_pattern") or {})
        self.rslora = bool(config.get("use_rslora", False))

    def of(self, module: str, r: int) -> float:
        alpha = next((float(v) for k, v in self.patterns.items() if re.match(rf"(.*\.)?{k}$", module)), self.alpha)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


class LoraStack(nn.Module):
    """Every device slot's adapter of one fused linear (``out_sizes``: its slices, e.g. q, k, v)."""

    def __init__(self, in_features: int, out_sizes: tuple[int, ...], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, lora_a: Optional[torch.Tensor] = None) -> None:
        """``lora_a``: zeros of the stack's A shape to use (the joined layout's tail), else allocated."""
        super().__init__()
        self.out_sizes, self.max_rank = out_sizes, max_rank
        ranks = len(out_sizes) * max_rank
        if lora_a is None:
            lora_a = torch.zeros(num_slots, ranks, in_features, dtype=dtype, device=device)
        self.register_buffer("lora_a", lora_a, persistent=False)  # [S, slices * R, in]
        self.register_buffer("lora_b", torch.zeros(num_slots, ranks, sum(out_sizes), dtype=dtype, device=device),
                             persistent=False)  # [S, slices * R, out]

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kiln.add_lora(y, x, self.lora_a, self.lora_b, list(self.out_sizes))

    @torch.no_grad()
    def write(self, index: int, slices: list[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Stack row ``index`` holds ``slices`` (per output slice an (A [r, in], B.T [r, out]) or None)."""
        self.lora_a[index].zero_()
        self.lora_b[index].zero_()
        offset = 0
        for j, (size, pair) in enumerate(zip(self.out_sizes, slices)):
            if pair is not None:
                a, b = pair
                r0 = j * self.max_rank
                self.lora_a[index, r0:r0 + a.shape[0]].copy_(a)
                self.lora_b[index, r0:r0 + a.shape[0], offset:offset + size].copy_(b)
            offset += size


STACKS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
          "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}
LINEARS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}  # each stack's linear


def join_rows(linear: nn.Module, num_slots: int, ranks: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Move ``linear``'s weight [out, in] to the head of a buffer [out + S * ranks, in] and return
    the tail as zeros [S, ranks, in] (the joined layout); None for a linear that is not a plain
    ``nn.Linear`` of ``dtype`` without a bias (a quantized one keeps its own GEMM)."""
    w = linear.weight if type(linear) is nn.Linear else None
    if w is None or linear.bias is not None or w.dtype != dtype or w.dim() != 2 or not w.is_contiguous():
        return None
    n, k = w.shape
    buffer = torch.empty(n + num_slots * ranks, k, dtype=dtype, device=w.device)
    with torch.no_grad():
        buffer[:n].copy_(w)
        buffer[n:].zero_()
    linear.weight = nn.Parameter(buffer[:n], requires_grad=False)
    return buffer[n:].view(num_slots, ranks, k)


class ModelLoras:
    """The ``LoraStack``s of one model and how an adapter is written into (or cleared from) a slot."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, join_shrink: bool = False) -> None:
        if not hasattr(model, "layers") or not hasattr(model, "arch"):
            raise ValueError("LoRA adapters are served on kiln's native models and on transformers' "
                             "Llama-family layouts (the generic path); this model is neither")
        self.shapes = module_shapes(model)  # whole, as adapters hold them
        self.shards = module_shards(model)  # this rank's slice of each
        local = {t: _local(shape, self.shards[t]) for t, shape in self.shapes.items()}
        self.num_layers = len(model.layers)
        self.stacks: list[dict[str, LoraStack]] = []
        self.num_joined = 0  # stacks in the joined layout
        for layer in model.layers:
            stacks = {}
            for group, (owner, targets) in STACKS.items():
                if targets[0] not in local:  # a sparse MLP: attention stacks only
                    continue
                in_features = local[targets[0]][0]
                out_sizes = tuple(local[t][1] for t in targets)
                linear = getattr(getattr(layer, owner), LINEARS[group])
                lora_a = None
                if join_shrink and tuple(linear.weight.shape) == (sum(out_sizes), in_features):
                    lora_a = join_rows(linear, num_slots, len(out_sizes) * max_rank, dtype)
                self.num_joined += lora_a is not None
                stack = LoraStack(in_features, out_sizes, num_slots, max_rank, dtype, device, lora_a)
                setattr(getattr(layer, owner), f"{group}_lora", stack)
                stacks[group] = stack
            self.stacks.append(stacks)
        if self.num_joined and torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the moved weights' old blocks: the KV cache is sized from free memory

    def write(self, index: int, adapter: Optional[LoraAdapter]) -> None:
        """Slot row ``index`` holds ``adapter`` (None: zeros)."""
        modules = adapter.modules if adapter is not None else {}
        for layer, stacks in enumerate(self.stacks):
            for group, stack in stacks.items():
                stack.write(index, [shard_module(modules[(layer, t)], self.shards[t])
                                    if (layer, t) in modules else None for t in STACKS[group][1]])


class _LinearWithLora(nn.Module):
    """A transformers model's ``nn.Linear`` followed by its ``LoraStack`` (the generic path)."""

    def __init__(self, base: nn.Linear, lora: LoraStack) -> None:
        super().__init__()
        self.base, self.lora = base, lora

    @property
    def weight(self) -> torch.Tensor:  # read by modeling code that asks for the linear's dtype
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return self.lora(y.reshape(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])).view_as(y)


class GenericLoras:
    """The ``LoraStack``s of a transformers model on the generic path: every decoder layer's
    projections (``model.layers.<i>.self_attn.q_proj``, ... ``mlp.down_proj``, PEFT's own module
    names) are plain ``nn.Linear``s, each followed by a stack of its own (one slice)."""

    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        layers = getattr(getattr(getattr(model, "hf", None), "model", None), "layers", None)
        if layers is None:
            raise ValueError("LoRA adapters are served on models whose decoder layers are model.layers "
                             "(the Llama family's layout); this model has none")
        self.stacks: list[dict[str, LoraStack]] = []
        for i, layer in enumerate(layers):
            stacks = {}
            for target in TARGETS:
                owner = getattr(layer, "self_attn" if target in ATTENTION_TARGETS else "mlp", None)
                linear = getattr(owner, target, None)
                if type(linear) is not nn.Linear:
                    raise ValueError(f"LoRA adapters: model.layers.{i}.{target} is "
                                     f"{type(linear).__name__ if linear is not None else 'missing'}, not a plain "
                                     "Linear (a sparse MoE block, a quantized or fused projection)")
                stacks[target] = LoraStack(linear.in_features, (linear.out_features,), num_slots, max_rank, dtype,
                                           device)
                setattr(owner, target, _LinearWithLora(linear, stacks[target]))
            self.stacks.append(stacks)
        first = self.stacks[0]
        self.shapes = {t: (first[t].lora_a.shape[2], first[t].out_sizes[0]) for t in TARGETS}
        self.shards: dict[str, Shard] = dict.fromkeys(TARGETS)
        self.num_layers = len(layers)
        self.num_joined = 0

    def write(self, index: int, adapter: Optional[LoraAdapter]) -> None:
        modules = adapter.modules if adapter is not None else {}
        for layer, stacks in enumerate(self.stacks):
            for target, stack in stacks.items():
                stack.write(index, [modules.get((layer, target))])


def attach_lora(model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                device: torch.device, join_shrink: bool = False) -> "ModelLoras | GenericLoras":
    """Give ``model``'s targeted linears ``num_slots`` adapter slots of rank ``max_rank`` (all zero),
    in the joined layout where ``join_shrink`` and the linear allow (native models only)."""
    if hasattr(model, "hf"):
        return GenericLoras(model, num_slots, max_rank, dtype, device)
    return ModelLoras(model, num_slots, max_rank, dtype, device, join_shrink)
