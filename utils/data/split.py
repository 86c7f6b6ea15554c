"""DeepSpeed-Chat's seeded three-phase split (pure numpy, no heavy imports).

For N rows and split ``s1,s2,s3``: p_i = s_i / sum(s); boundaries b_0 = 0,
b_{i+1} = b_i + round(p_i * N) (Python's round, as the reference); then the
overshoot (b_3 - N) is subtracted from every b_i with i >= 1 (clamped at 0, where the
reference can produce b_1 = -1 and overlapping phases). The permutation is
``numpy.random.RandomState(seed).shuffle(arange(N))`` and phase i gets
``perm[b_i:b_{i+1}]``. Index files are cached as
``{out}/{name}_seed{seed}_{split_name}_{data_split}_{i}.npy``.
"""
from __future__ import annotations

import os
from typing import List, Sequence

import numpy as np

from utils.errors import UserInputError
from utils.files import atomic_write


def parse_data_split(data_split: str, expected: int = 3) -> List[float]:
    """``"2,4,4"`` -> ``[0.2, 0.4, 0.4]``; a clear error for anything else."""
    parts = [p.strip() for p in str(data_split).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise UserInputError(
            f"--data_split {data_split!r}: expected {expected} comma-separated numbers "
            "(one share per phase), e.g. 2,4,4") from None
    if len(values) != expected:
        raise UserInputError(
            f"--data_split {data_split!r}: expected {expected} comma-separated numbers "
            f"(one share per phase), got {len(values)}")
    if any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise UserInputError(
            f"--data_split {data_split!r}: shares must be non-negative and sum to more than 0")
    total = sum(values)
    return [v / total for v in values]


def split_boundaries(data_size: int, proportions: Sequence[float]) -> List[int]:
    """Boundaries b_0..b_k of the reference's split (see module docstring)."""
    bounds = [0]
    for i, p in enumerate(proportions):
        bounds.append(bounds[i] + int(round(p * float(data_size))))
    diff = bounds[-1] - data_size
    for i in range(1, len(bounds)):
        # max(., 0): the reference lets b_1 go to -1 (e.g. split 0,1,1 with N = 7 gives
        # [0, -1, 3, 7]), so perm[0:-1] and perm[-1:3] overlap or vanish; clamping keeps
        # the phases disjoint and covering (b_i, i >= 1, are non-decreasing, b_k = N).
        bounds[i] = max(bounds[i] - diff, 0)
    return bounds


def split_indices(data_size: int, data_split: str, seed: int, expected: int = 3) -> List[np.ndarray]:
    """All phases' row indices for one dataset split (no caching)."""
    bounds = split_boundaries(data_size, parse_data_split(data_split, expected))
    perm = np.arange(data_size, dtype=np.uint32)
    np.random.RandomState(seed=seed).shuffle(perm)
    return [perm[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]


def get_split_index(output_path: str, dataset_name: str, seed: int, split_name: str,
                    data_split: str, split_index: int, data_size: int,
                    expected: int = 3) -> np.ndarray:
    """Phase ``split_index``'s indices, cached as .npy index files under ``output_path``.

    The files are written once (atomically) and reused, as the reference does. A
    cached file whose indices do not fit ``data_size`` is rebuilt.
    """
    safe_name = dataset_name.replace("/", "_").replace(os.sep, "_")
    def path(i):
        return os.path.join(output_path, f"{safe_name}_seed{seed}_{split_name}_{data_split}_{i}.npy")
    wanted = path(split_index)
    if os.path.isfile(wanted):
        try:
            idx = np.load(wanted, allow_pickle=False)
            if idx.size == 0 or int(idx.max()) < data_size:
                return idx
        except (ValueError, OSError, EOFError):  # truncated or not an index: rebuilt below
            pass
    try:
        os.makedirs(output_path, exist_ok=True)
    except OSError as e:
        raise UserInputError(f"--data_output_path {output_path}: cannot create it ({e.strerror or e})") from None
    indices = split_indices(data_size, data_split, seed, expected)
    for i, idx in enumerate(indices):
        def write(tmp, idx=idx):
            with open(tmp, "wb") as f:  # np.save would append ".npy" to a name without it
                np.save(f, idx, allow_pickle=False)
        atomic_write(path(i), write, "the data split index")
    return indices[split_index]
