"""Native decoder models in plain PyTorch, their registry, and the weight loaders.

- ``arch``: ``ArchConfig`` (read from / written to ``config.json``), family traits, the presets.
- ``llama``: the one model implementation (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3, OLMo-2, Granite).
- ``rope``: RoPE frequency tables of every supported scaling type.
- ``moe``: the mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE.
- ``hf_generic``: the generic path (``model.impl=transformers``): transformers' own modeling code over
  kiln's flat batch and paged attention.
- ``gguf``: one-time GGUF -> Hugging Face directory conversion into the cache dir.
- ``registry``: registered model names and the packages that ship them.
- ``loader``: ``load_model(ModelConfig, ...) -> LoadedModel``.
"""

from kiln.models.arch import PRESETS, ArchConfig
from kiln.models.llama import LlamaForCausalLM
from kiln.models.loader import LoadedModel, load_model, resolve_device, resolve_dtype

__all__ = ["ArchConfig", "PRESETS", "LlamaForCausalLM", "LoadedModel", "load_model", "resolve_device", "resolve_dtype"]
