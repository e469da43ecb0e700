"""kiln: an LLM serving engine whose core is a compiler."""

import kiln.clock  # noqa: F401 - first: start-up phases count from here (kiln.clock.KILN_IMPORTED)
from kiln.sampling_params import SamplingParams, StructuredOutputsParams
from kiln.lora_request import LoRARequest
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.version import __version__


def __getattr__(name):
    # LLM pulls in the whole runtime; import it on first use so `import kiln` stays light.
    if name == "LLM":
        from kiln.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "CompletionOutput", "RequestOutput", "__version__"]
