"""kiln's benchmark tools, each ``python -m benchmarks.<tool> <subcommand>`` with ``--help``:

    serve     the OpenAI server: load at a rate, server against offline, soak, structured output
    offline   ``LLM.generate`` throughput: profiles, precisions, speculation, MoE, TP, compile modes
    startup   launch to ready and to full speed, the background build, weight loading
    decode    batch-1 decode: roofline, kernels of a step, host costs of a step
    kernels   single kernels against their references and torch's
    (and ``kiln bench``, in ``kiln/bench/``: sweeps over config values)

Every tool stores its runs in ``benchmarks/results/<tool>-<card>.{json,md}`` (``benchmarks.results``),
the records in ``kiln.bench.report``'s format; shared helpers are in ``benchmarks.common``.
"""
