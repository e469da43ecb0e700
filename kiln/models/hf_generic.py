"""The generic path (``model.impl=transformers``): any decoder-only ``*ForCausalLM`` of transformers,
its own modeling code unmodified, over kiln's flat batch and paged KV cache.

``HFGenericForCausalLM`` wraps the transformers model and keeps kiln's model contract
(``forward(input_ids [T], positions [T]) -> hidden [T, hidden]``, ``compute_logits``): the flat
batch runs as one sequence of batch 1 with ``position_ids``, without a transformers cache. Each
attention layer reaches ``torch.ops.kiln.attend_paged``, which writes k/v into the paged cache and
attends each request over its own context, in one of two ways:

- ``compile.mode=eager`` and ``stock``: the model runs with attention implementation ``"kiln"``,
  registered in transformers' ``AttentionInterface`` (``kiln_attention_forward``): it hands the
  layer's q, k, v (after rotary) to the kiln op. transformers builds no mask for an attention
  implementation it has no mask function for, so none is computed.
- ``compile.mode=kiln``: the model is captured with ``"kiln_sdpa"`` (``capture_scope``):
  transformers' own SDPA attention and SDPA masks, so the Dynamo graph holds the model's own
  ``scaled_dot_product_attention`` calls and its mask construction;
  ``kiln.passes.sdpa_to_paged.SDPAToPagedAttentionPass`` swaps each call for the paged op and removes
  the mask construction left dead.

Sliding windows and attention logit soft-caps are what transformers hands its attention function
(the ``sliding_window`` and ``softcap`` arguments), layer by layer. The eager function passes them
on to the paged op; for the captured graph, where SDPA cannot express a soft-cap and the window
is only in the (removed) mask, the load-time probe records them per layer
(``HFGenericForCausalLM.attention_layers``) and the attention pass writes them into each call.

Rules kept here:
- The model is built with its parameters on the meta device and its buffers (rotary tables)
  computed as transformers computes them; parameters are then allocated once on the target
  device in the target dtype and filled one checkpoint tensor at a time. The ``nn.Linear``
  children of a module that share an input size (q/k/v, gate/up) get one buffer, end to end
  (``lay_out_sibling_linears``), so that ``MergeSiblingLinearsPass`` runs those that read the
  same input as one GEMM.
- What kiln's attention cannot compute is refused before anything is built, with the reason
  (``unsupported_reason``): layer kinds other than full and sliding-window attention,
  encoder-decoder and non-causal models, RoPE whose frequencies depend on the batch (dynamic NTK,
  long-rope), ALiBi and other position biases; and at the attention call, any argument kiln's
  attention has no equivalent for (attention sinks, position biases). Never wrong tokens.
- Tensor parallelism is refused: the generic model holds whole weights.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import nn

import kiln.ops  # noqa: F401  (registers torch.ops.kiln.attend_paged)
from kiln.forward_context import ForwardContext, forward_context

IMPLS = ("auto", "native", "transformers")
ATTENTION_NAME = "kiln"  # the attention implementation registered in transformers' AttentionInterface
CAPTURE_ATTENTION = "kiln_sdpa"  # what compile.mode=kiln captures (transformers' SDPA), for the attention pass
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention")


# Held while transformers is first imported. Meanwhile transformers puts a lazy module of itself in
# sys.modules, and another thread's ``from transformers import X`` fails ("cannot import name")
# instead of waiting. A start builds its tokenizer on a thread, and that thread can still be
# importing when a start that failed is retried.
_TRANSFORMERS_IMPORT = threading.Lock()


def import_transformers() -> None:
    """Import transformers, one thread at a time; every kiln path into transformers calls it first."""
    with _TRANSFORMERS_IMPORT:
        import transformers  # noqa: F401


@dataclass(frozen=True)
class GenericArch:
    """What kiln's runtime reads of a model (KV cache shape, vocabulary, stop tokens), for the
    generic path. The model itself is described by its transformers config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    bos_token_id: Optional[int] = None
    eos_token_id: tuple[int, ...] = ()
    family: str = ""  # the config's model_type
    architecture: str = ""  # the *ForCausalLM class
    impl: str = "transformers"

    @property
    def context_limit(self) -> int:
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(cls, config: Any) -> "GenericArch":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        eos = getattr(text, "eos_token_id", None)
        eos = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
        archs = getattr(config, "architectures", None) or [""]
        return cls(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // num_heads,
            max_position_embeddings=getattr(text, "max_position_embeddings", None) or 2048,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=eos,
            family=getattr(config, "model_type", ""),
            architecture=archs[0],
        )


# ---- what the generic path refuses --------------------------------------------------------------
_DYNAMIC_ROPE = ("dynamic", "longrope")  # frequencies chosen from the batch's largest position


def unsupported_reason(config: Any) -> Optional[str]:
    """Why kiln's paged attention cannot run this transformers config, or None when it can."""
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (kiln runs decoder-only causal LMs)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or ()
    if any(t not in ATTENTION_LAYER_KINDS for t in layer_types):
        kinds = sorted(set(layer_types) - set(ATTENTION_LAYER_KINDS))
        return f"it has {kinds} layers (kiln's attention has full and sliding-window layers only)"
    if getattr(text, "alibi", False) or getattr(text, "position_embedding_type", "rope") == "alibi":
        return "it uses ALiBi position biases, which kiln's attention lacks"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict):
        # transformers 5 may nest per-layer-kind parameters: {"full_attention": {...}}.
        params = [rope] + [v for v in rope.values() if isinstance(v, dict)]
        for p in params:
            rope_type = p.get("rope_type", p.get("type"))
            if rope_type in _DYNAMIC_ROPE:
                return (f"its RoPE type {rope_type!r} picks frequencies from the batch's longest sequence, "
                        "which a flat batch of many requests cannot reproduce")
    return None


def check_supported(config: Any, tp_size: int = 1) -> None:
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(f"model.impl=transformers cannot run {getattr(config, 'model_type', '?')!r}: {reason}")
    if tp_size != 1:
        raise ValueError("model.impl=transformers does not support tensor parallelism "
                         f"(parallel.tensor_parallel_size={tp_size}); use parallel.tensor_parallel_size=1, "
                         "or model.impl=native for a family kiln implements")


# ---- attention ------------------------------------------------------------------------------------
def kiln_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                           dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [1, H, T, D], k/v [1, KVH, T, D] (after rotary) ->
    ([1, T, H, D], None), through ``torch.ops.kiln.attend_paged`` on the layer's paged cache, with
    the layer's sliding window and logit soft-cap when transformers passes them."""
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{type(module).__name__} passes {name!r} to its attention, which kiln's attention lacks")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal; kiln's paged attention is causal only")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]; the kernels' output then has q's layout
    k = key[0].transpose(0, 1)  # [T, KVH, D]
    v = value[0].transpose(0, 1)
    window, softcap = attention_options(type(module).__name__, kwargs)
    options = {}
    if window:  # passed only when set, as the native model does: other graphs stay the same
        options["sliding_window"] = window
    if softcap:
        options["logit_softcap"] = softcap
    o = torch.ops.kiln.attend_paged(q, k, v, module.layer_idx, float(scale), **options)  # [T, H, D]
    return o.unsqueeze(0), None


def attention_options(where: str, kwargs: dict[str, Any]) -> tuple[int, float]:
    """(sliding window, logit soft-cap) of transformers' attention arguments, 0 where unset.

    transformers' window (``sliding_window=w``) lets a query see itself and the w - 1 keys before
    it, as kiln's ``sliding_window`` does."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{where} asks for sliding_window={window!r}; kiln's attention takes a positive int")
    if softcap is not None and not float(softcap) > 0:
        raise ValueError(f"{where} asks for softcap={softcap!r}; kiln's attention takes a positive float")
    return int(window or 0), float(softcap or 0.0)


def capture_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: Optional[torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, as compile.mode=kiln captures it. A soft-cap (which SDPA
    lacks and transformers' SDPA function refuses) is left out: the attention pass replaces every
    call with the paged op, which applies the layer's recorded soft-cap, and a graph still holding
    an SDPA call is never run (``check_no_sdpa_left``)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kwargs.pop("softcap", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_attention() -> None:
    """Make ``attn_implementation="kiln"`` (and ``"kiln_sdpa"``, the capture's, with transformers'
    SDPA masks) known to transformers (idempotent)."""
    import_transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, kiln_attention_forward)
    AttentionInterface.register(CAPTURE_ATTENTION, capture_attention_forward)
    AttentionMaskInterface.register(CAPTURE_ATTENTION, sdpa_mask)


# ---- the model ------------------------------------------------------------------------------------
class HFGenericForCausalLM(nn.Module):
    """kiln's model contract around an unmodified transformers ``*ForCausalLM``."""

    impl = "transformers"

    def __init__(self, hf_model: nn.Module, arch: GenericArch) -> None:
        super().__init__()
        self.hf = hf_model
        self.arch = arch
        text = hf_model.config.get_text_config()
        # Logit post-processing some families configure (and transformers applies in their forward).
        self.logit_divisor = float(getattr(text, "logits_scaling", 1.0) or 1.0)  # Granite
        self.logit_scale = float(getattr(text, "logit_scale", 1.0) or 1.0)  # Cohere
        self.final_softcap = getattr(text, "final_logit_softcapping", None)  # Gemma 2
        # (sliding window, logit soft-cap) per layer, 0 where unset: what transformers passes each
        # layer's attention, recorded at load (``_probe_attention_layers``); the attention pass
        # writes them into the captured graph.
        self.attention_layers: tuple[tuple[int, float], ...] = ()

    @property
    def text_model(self) -> nn.Module:
        """The module whose attention runs on kiln's paged cache (a vision tower keeps its own)."""
        return self.hf

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final hidden states [num_tokens, hidden]."""
        out = self.hf.base_model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                 use_cache=False)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32, as the transformers model's head computes them."""
        logits = self.hf.get_output_embeddings()(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.logit_divisor != 1.0:
            logits = logits / self.logit_divisor
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    @contextlib.contextmanager
    def capture_scope(self) -> Iterator[None]:
        """Entered around Dynamo's capture (compile.mode=kiln): attention runs as SDPA, for the
        attention pass to find and replace; back to ``"kiln"`` afterwards."""
        _set_attention(self.text_model, CAPTURE_ATTENTION)
        try:
            yield
        finally:
            _set_attention(self.text_model, ATTENTION_NAME)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (transformers names) in; every parameter must be given, except
        those tied to another."""
        load_into(self.hf, weights)


def _set_attention(hf_model: nn.Module, name: str) -> None:
    for config in {id(c): c for c in _configs(hf_model)}.values():
        config._attn_implementation = name


def _configs(hf_model: nn.Module) -> Iterator[Any]:
    for m in hf_model.modules():
        c = getattr(m, "config", None)
        if c is not None and hasattr(c, "_attn_implementation"):
            yield c


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters created inside go to the meta device; buffers (rotary tables) are computed for real."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_hf_model(config: Any, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The transformers model of ``config`` with uninitialized parameters allocated once on
    ``device`` in ``dtype``, buffers as transformers computes them, tied weights tied."""
    import_transformers()
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    register_attention()
    with _parameters_on_meta():
        if getattr(config, "vision_config", None) is not None:  # the vision tower attends with SDPA
            attention = {"": ATTENTION_NAME, "text_config": ATTENTION_NAME, "vision_config": "sdpa"}
            model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation=attention)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION_NAME)
    buffers = {name: b for name, b in model.named_buffers()}
    for name, b in buffers.items():
        if b.device.type == "meta":
            raise ValueError(f"buffer {name!r} of {type(model).__name__} was not computed at construction")
    model.to_empty(device=device)  # parameters: allocated, not initialized; buffers: garbage
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name].to(b.dtype))
    model.tie_weights()
    lay_out_sibling_linears(model)
    return model.eval().requires_grad_(False)


def lay_out_sibling_linears(model: nn.Module) -> int:
    """Give the ``nn.Linear`` children of each module that share an input size (q/k/v and o of an
    attention, gate and up of an MLP) one weight buffer, end to end in declaration order (biases
    likewise), so that ``MergeSiblingLinearsPass`` can run the ones that read the same input as one
    GEMM over a view of it. Values are not kept (call before loading weights); tied weights are left
    alone. Returns how many buffers were made."""
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    made = 0
    for module in model.modules():
        groups: dict[tuple, list[nn.Linear]] = {}
        for child in module.children():
            if type(child) is not nn.Linear or counts.get(id(child.weight), 0) > 1:
                continue
            w = child.weight
            key = (w.shape[1], w.dtype, w.device, child.bias is not None)
            groups.setdefault(key, []).append(child)
        for (k, dtype, device, has_bias), linears in groups.items():
            if len(linears) < 2:
                continue
            rows = [lin.weight.shape[0] for lin in linears]
            weight = torch.empty(sum(rows), k, dtype=dtype, device=device)
            bias = torch.empty(sum(rows), dtype=linears[0].bias.dtype, device=device) if has_bias else None
            start = 0
            for lin, n in zip(linears, rows):
                lin.weight.data = weight[start:start + n]
                if bias is not None:
                    lin.bias.data = bias[start:start + n]
                start += n
            made += 1
    return made


@torch.no_grad()
def load_into(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into ``model``: by name, or, for parameters transformers holds in
    another layout than its checkpoints, through ``CheckpointLayout``. Every parameter must be
    filled whole, except those tied to another."""
    params = dict(model.named_parameters(remove_duplicate=False))
    persistent = {n: b for n, b in model.named_buffers() if _is_persistent(model, n)}
    targets = {**params, **persistent}
    layout: Optional[CheckpointLayout] = None  # built at the first name not found
    filled: dict[int, int] = {}  # id(parameter) -> elements copied into it
    for name, tensor in weights:
        dest = targets.get(name)
        if dest is None:
            layout = CheckpointLayout(model) if layout is None else layout
            param = layout.fill(name, tensor)
            if param is not None:
                filled[id(param)] = filled.get(id(param), 0) + tensor.numel()
                continue
            if name.endswith("rotary_emb.inv_freq"):
                continue  # older checkpoints saved the rotary table; it is computed, not loaded
            raise ValueError(f"unexpected weight {name!r} for {type(model).__name__}")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
        del tensor
        filled[id(dest)] = filled.get(id(dest), 0) + dest.numel()
    missing = sorted(n for n, p in params.items() if filled.get(id(p), 0) < p.numel())
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s): {missing[:5]}{more}")


class CheckpointLayout:
    """Where a checkpoint tensor goes in a parameter that transformers holds in another layout
    than it saves (transformers 5 stacks a mixture of experts' per-expert weights into one tensor).

    No per-model code: transformers' own save-time conversion (``revert_weight_conversion``) is
    run on the parameter's element indices (``arange(numel)`` in its shape), which gives, for each
    checkpoint name, the flat index of each of its elements in the parameter. A conversion must
    only move elements (stack, split, chunk, transpose): the indices must stay integers and cover
    the parameter exactly once, else the model is refused. Index maps are built per parameter at
    its first checkpoint tensor and dropped once used (transient memory: about two int64 copies
    of that one parameter)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.param_of: dict[str, str] = {}  # checkpoint name -> parameter name
        self.indices: dict[str, torch.Tensor] = {}  # checkpoint name -> flat indices into its parameter
        try:
            from transformers.core_model_loading import revert_weight_conversion
        except ImportError:  # a transformers without weight conversions saves what it holds
            self.revert = None
            return
        self.revert = revert_weight_conversion
        params = dict(model.named_parameters())
        converted = set(self._revert({n: torch.empty_like(p, device="meta") for n, p in params.items()}))
        for pname, p in params.items():
            if pname in converted:
                continue  # saved as held
            for cname in self._revert({pname: torch.empty_like(p, device="meta")}):
                self.param_of[cname] = pname

    def _revert(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.revert(self.model, state) if self.revert is not None else state

    def fill(self, name: str, tensor: torch.Tensor) -> Optional[nn.Parameter]:
        """Copy checkpoint tensor ``name`` into its parameter and return it; None if ``name`` is
        no part of a converted parameter."""
        pname = self.param_of.get(name)
        if pname is None:
            return None
        param = self.model.get_parameter(pname)
        if name not in self.indices:
            self._index(pname, param)
        idx = self.indices.pop(name)
        if tuple(idx.shape) != tuple(tensor.shape):
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(idx.shape)}")
        param.view(-1).index_copy_(0, idx.reshape(-1).to(param.device), tensor.reshape(-1).to(param.dtype))
        return param

    def _index(self, pname: str, param: torch.Tensor) -> None:
        numel = param.numel()
        dtype = torch.int32 if numel < 2**31 else torch.int64
        pieces = self._revert({pname: torch.arange(numel, dtype=dtype).view(param.shape)})
        seen = torch.zeros(numel, dtype=torch.int32)
        for cname, idx in pieces.items():
            if idx.dtype != dtype or self.param_of.get(cname) != pname:
                raise ValueError(f"model.impl=transformers cannot load {type(self.model).__name__}: transformers "
                                 f"converts checkpoint weight {cname!r} into {pname!r} with more than a layout change")
            flat = idx.reshape(-1).long()
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= numel):
                seen.zero_()  # indices out of the parameter: not a layout change
                break
            seen.index_add_(0, flat, torch.ones(flat.numel(), dtype=torch.int32))
        if not bool((seen == 1).all()):
            raise ValueError(f"model.impl=transformers cannot load {type(self.model).__name__}: the checkpoint weights "
                             f"of {pname!r} ({sorted(pieces)[:3]}...) do not cover it exactly once")
        self.indices.update((c, i.long()) for c, i in pieces.items())


def _is_persistent(model: nn.Module, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf not in module._non_persistent_buffers_set


def _check_causal(model: nn.Module) -> None:
    for name, m in model.named_modules():
        if hasattr(m, "layer_idx") and getattr(m, "is_causal", True) is False:
            raise ValueError(f"model.impl=transformers cannot run {type(model).__name__}: attention {name!r} "
                             "is not causal; kiln's paged attention is causal only")


def build_generic(config: Any, device: torch.device, dtype: torch.dtype, tp_size: int = 1,
                  wrapper: type = HFGenericForCausalLM) -> HFGenericForCausalLM:
    """The generic model of a transformers config with uninitialized weights (``load_weights`` next);
    ``wrapper``: kiln's model class around it (``kiln.models.hf_multimodal`` passes its own)."""
    check_supported(config, tp_size)
    hf_model = build_hf_model(config, device, dtype)
    model = wrapper(hf_model, GenericArch.from_hf_config(hf_model.config))
    _check_causal(model.text_model)
    _probe_attention_layers(model)
    return model


_PROBE_NAME = "kiln_probe"


@torch.no_grad()
def _probe_attention_layers(model: HFGenericForCausalLM) -> None:
    """Run one token through the model with a recording attention function: every layer must
    reach transformers' attention interface exactly once, in order, with its own ``layer_idx``.
    A model that computes attention in code of its own would bypass kiln's paged cache."""
    from transformers import AttentionInterface

    seen: list[int] = []
    options: list[tuple[int, float]] = []

    def record(module, query, key, value, attention_mask, **kwargs):
        seen.append(getattr(module, "layer_idx", -1))
        options.append(attention_options(type(module).__name__, kwargs))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(_PROBE_NAME, record)
    device = next(model.parameters()).device
    one = torch.zeros(1, dtype=torch.int64, device=device)
    _set_attention(model.text_model, _PROBE_NAME)
    try:
        with forward_context(ForwardContext(attn=None, kv_caches=[])):  # kiln.merge_mm_embeds reads it
            model(one, one)
    finally:
        _set_attention(model.text_model, ATTENTION_NAME)
    if seen != list(range(model.arch.num_layers)):
        raise ValueError(f"model.impl=transformers cannot run {type(model.hf).__name__}: its attention does not go "
                         f"through transformers' attention interface once per layer in order (saw layers {seen[:8]}, "
                         f"expected 0..{model.arch.num_layers - 1}), so kiln cannot give it a paged cache")
    model.attention_layers = tuple(options)


def hf_config_from_dict(d: dict[str, Any]) -> Any:
    """A transformers config object from a ``config.json`` dict."""
    import_transformers()
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError("config.json has no model_type; cannot pick a transformers model class")
    try:
        return AutoConfig.for_model(model_type, **d)
    except ValueError as e:
        raise ValueError(f"transformers does not know model_type {model_type!r}: {e}") from e


__all__ = ["GenericArch", "HFGenericForCausalLM", "IMPLS", "build_generic", "check_supported", "hf_config_from_dict",
           "kiln_attention_forward", "lay_out_sibling_linears", "register_attention", "unsupported_reason"]
