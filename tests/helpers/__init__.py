"""What several test files share, one module per topic; a test file imports from here, never from
another test file. Nothing here is collected (no ``test_*`` names) and importing this package pulls
in nothing: each module imports only what its own helpers need.

- ``paths``: the checkout and ``tests/data``.
- ``paged``: flat batches over a toy paged KV cache, and one forward over them.
- ``triton_interpreter``: a test file's kernel tests rerun in a child pytest under Triton's interpreter.
- ``hf``: tiny Hugging Face checkpoints (toy tokenizer, MoE configs) and transformers' logits.
- ``quant``: the small models and graphs the quantization tests share.
- ``perplexity``: the quality text and perplexity of one prefill over it.
- ``cuda_graphs``: the workloads and emulated capture of the CUDA-graph tests.
- ``parallel``: the tensor-parallel check that two engines' completions agree.
- ``ray_executor``: Ray if installed, and the Ray executor tests' workload.
- ``server``: a real uvicorn server on a free port, a stand-in engine, and response checks.
- ``threads``: torch's thread count for a block of code.
"""
