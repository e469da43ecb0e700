import os
import platform
import sys

from setuptools import find_packages, setup


def cpu_extensions() -> dict:
    """``kiln._C``: the C++ CPU kernels in ``csrc/`` (see ``kiln/ops/cpu_attention.py``).

    Optional: without torch at build time (an isolated build) or with a compiler that fails, kiln
    installs without it and runs the pure-torch reference. Set KILN_REQUIRE_EXTENSION=1 to make a
    failed build an error instead, or KILN_SKIP_EXTENSION=1 not to build it at all (a quick
    pure-Python build, as the packaging test makes).
    """
    if os.environ.get("KILN_SKIP_EXTENSION") == "1":
        print("kiln: KILN_SKIP_EXTENSION=1; not building the C++ extension kiln._C", file=sys.stderr)
        return {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("kiln: torch not importable at build time; skipping the C++ extension kiln._C", file=sys.stderr)
        return {}
    # Portable: the hot loop carries its own x86-64-v3/v4 clones (csrc/paged_attention.cpp),
    # so the baseline stays at a level every x86-64 CI machine has. Never -march=native.
    arch = ["-march=x86-64-v2"] if platform.machine() in ("x86_64", "AMD64") else []
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]  # Apple clang has no OpenMP by default
    ext = CppExtension(
        "kiln._C",
        ["csrc/paged_attention.cpp", "csrc/attention_context.cpp", "csrc/gemv.cpp", "csrc/gemv_q8_0.cpp"],
        depends=["csrc/vec.h", "csrc/paged_attention.h", "csrc/error.h"],
        extra_compile_args=["-O3", "-fno-math-errno", *arch, *openmp],
        # libgomp has the soname of the copy torch ships, so the process has one OpenMP runtime; the
        # rpath lets `import kiln._C` find libtorch even before torch is imported.
        extra_link_args=[*openmp, f"-Wl,-rpath,{os.path.join(os.path.dirname(torch.__file__), 'lib')}"],
    )

    class OptionalBuildExtension(BuildExtension):
        def run(self):
            try:
                super().run()
            except Exception as e:  # a missing or broken compiler must not break the install
                if os.environ.get("KILN_REQUIRE_EXTENSION") == "1":
                    raise
                print(f"kiln: building kiln._C failed ({e}); kiln will use the pure-torch reference",
                      file=sys.stderr)

    return dict(ext_modules=[ext], cmdclass={"build_ext": OptionalBuildExtension.with_options(use_ninja=False)})


setup(
    name="kiln",
    version="0.1.0",
    description="An LLM serving engine whose core is a compiler",
    packages=find_packages(include=["kiln", "kiln.*"]),
    python_requires=">=3.10",
    # The one place kiln's dependencies and their versions are declared. The Makefile installs torch
    # first (a pinned build, see TORCH there), then `-e .[bench,debug,ray]` and requirements-dev.txt.
    install_requires=[
        "torch>=2.6",
        "transformers>=4.50",
        "safetensors",
        "gguf>=0.10",
        "numpy",
        "sympy",  # shape expressions in kiln.compiler (torch depends on it too)
        "tqdm",
        "jinja2",  # chat templates
        "hydra-core>=1.3",
        "omegaconf>=2.3",
        "fastapi",
        "pydantic>=2",
        "starlette",  # fastapi's own, whose HTTPException kiln's error handlers catch
        "uvicorn",
        "prometheus-client",
        "xgrammar>=0.1.25",  # structured outputs: grammars, token bitmasks (what vLLM and SGLang use)
        "pyzmq>=25",  # the frontend <-> engine-core process sockets (kiln.engine)
        "msgspec>=0.18",  # the typed messages between them (kiln.engine.messages)
    ],
    extras_require={
        # `kiln bench`: its plots (without matplotlib a sweep writes only its table) and bench=serve's client.
        "bench": ["matplotlib", "httpx"],
        # compile.debug_dump_dir: decompiled Dynamo bytecode next to the graphs (skipped without depyf).
        "debug": ["depyf"],
        # parallel.backend=ray (tensor-parallel ranks as Ray actors, also across nodes); tested with 2.60.
        "ray": ["ray>=2.60"],
        # images in, text out (vision-language models): decoding images, fetching http(s) image URLs.
        "vision": ["pillow", "httpx"],
        # python -m benchmarks.serve llamacpp: llama.cpp on the same GGUF file (builds from source).
        "llamacpp": ["llama-cpp-python[server]>=0.3", "httpx"],
    },
    entry_points={"console_scripts": ["kiln=kiln.entrypoints.cli:main"]},
    # The Hydra YAML ships inside the package (kiln/configs/), so `kiln` works from a wheel too.
    package_data={"kiln": ["configs/*.yaml", "configs/*/*.yaml"]},
    **cpu_extensions(),
)
