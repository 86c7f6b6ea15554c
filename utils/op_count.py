"""Counting the aten ops a piece of code runs, and its host synchronisations, on any device (the CPU included).

On a GPU a decode step replayed from a CUDA graph costs about one kernel per aten op that computes something,
a few µs each, whatever its size; a host synchronisation (``.item()``, ``bool(t)``, ``nonzero``, ...) stalls the
CPU until the GPU drains. Both show on the CPU already: :class:`OpCounter` records every aten op dispatched under
it (``TorchDispatchMode``, i.e. after composite ops are decomposed: ``rms_norm`` counts its 6 CPU ops, one fused
kernel on CUDA), split into ops that launch work and views (a view or a fresh allocation launches no kernel).
tests/test_decode_ops.py keeps the decode step's counts bounded with it; bench/bench_generation.py reports them.
"""
from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that read a device value on the host: each one waits for the GPU to finish all queued work
HOST_SYNC_OPS = frozenset({
    "aten._local_scalar_dense", "aten.is_nonzero", "aten.item", "aten.equal", "aten.allclose", "aten.nonzero",
    "aten.nonzero_static", "aten.masked_select", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim",
    "aten.repeat_interleave", "aten._assert_async",
})
# ops that launch no kernel besides the views (an allocation, a reshape of a fresh tensor)
NO_KERNEL_OPS = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten._unsafe_view",
                           "aten.lift_fresh", "aten.sym_size", "aten.sym_stride", "aten.sym_numel"})


def op_name(func) -> str:
    """``"aten.mm"`` for ``aten.mm.default``: the overload packet's name."""
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}"


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as ops: ...``: ``ops.kernels`` (Counter of the ops that launch work, by name),
    ``ops.views`` (views and no-kernel ops), ``ops.syncs`` (host synchronisations, also in ``kernels``)."""

    def __init__(self):
        super().__init__()
        self.kernels = collections.Counter()
        self.views = collections.Counter()
        self.syncs = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = op_name(func)
        if func.is_view or name in NO_KERNEL_OPS:
            self.views[name] += 1
        else:
            self.kernels[name] += 1
        if name in HOST_SYNC_OPS:
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def kernel_count(self) -> int:
        return sum(self.kernels.values())

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())
