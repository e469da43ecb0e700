"""Programmatic dependent launch (PDL) for kiln's own Triton kernels on Hopper and later.

In a CUDA graph each kernel normally starts only once the one before it has finished and its
launch has gone through: about a microsecond a kernel, which at batch 1 (some 13 kernels a layer,
most of them a few microseconds long) is a tenth of an int4 step. cuBLAS's Hopper kernels already
launch this way. With PDL a kernel's blocks are launched while its predecessor still runs and
wait on the device (``griddepcontrol.wait``) until the predecessor has finished and its writes are
visible::

    without:  [ norm ]--gap--[ gemv ............ ]--gap--[ attention ]
    with:     [ norm ][ gemv ............ ][ attention ]     (blocks parked in gdc_wait meanwhile)

The rule every kernel launched with PDL keeps: ``gdc_wait`` runs in every program before any
load or store of memory another kernel writes or reads (so the order of every pair of kernels is
what it was), and ``gdc_launch_dependents`` only says the next kernel's blocks may be launched
(they still wait for this kernel to finish). In a kernel: ``if USE_PDL: tl.extra.cuda.gdc_wait()``
first, ``tl.extra.cuda.gdc_launch_dependents()`` once the bulk of its work is issued. Kernels take ``USE_PDL`` as a constexpr: off, they
compile to what they were; off on the CPU, in Triton's interpreter and before SM90. ``kernels.pdl=off``
turns it off, ``kernels.pdl=gemm`` keeps it for the weight-only GEMVs alone (to measure each part).
"""

from __future__ import annotations

import functools
import os

import torch

from kiln.ops.options import current


@functools.lru_cache(maxsize=None)
def _sm_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def use_pdl(t: torch.Tensor, kind: str = "other") -> bool:
    """Whether a kernel of ``kind`` ("gemm": the weight-only GEMVs; "other") on ``t``'s device
    launches with PDL (``kernels.pdl``)."""
    setting = current().pdl
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" or setting == "off":
        return False
    if setting == "gemm" and kind != "gemm":
        return False
    return _sm_major(t.device.index if t.device.index is not None else torch.cuda.current_device()) >= 9


def pdl_args(t: torch.Tensor, kind: str = "other") -> dict:
    """Launch keywords of a kernel taking ``USE_PDL``: the flag and, when on, ``launch_pdl``."""
    return dict(USE_PDL=True, launch_pdl=True) if use_pdl(t, kind) else dict(USE_PDL=False)

