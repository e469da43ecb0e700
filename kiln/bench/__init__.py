"""What ``kiln bench`` runs: the sweep (``sweep``: one Hydra job per combination, each measured by
``worker`` in a fresh process; ``serve`` loads the OpenAI server over HTTP), one results format and
its tables (``report``) and plots (``plots``). The tools in ``benchmarks/`` share the format.

Layering: this package sits beside ``kiln.entrypoints`` at the top; it may import the runtime and
the entrypoints (the ``LLM`` API, the server), and nothing under ``kiln.runtime`` or lower imports it.
"""
