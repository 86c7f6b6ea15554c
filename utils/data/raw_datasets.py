"""Raw datasets: one adapter per supported source, all with DeepSpeed-Chat's interface.

The interface and the text convention adapters render rows in:
:mod:`utils.data.prompt_dataset` (loading is lazy: constructing an adapter reads no
data). Sources (:func:`get_raw_dataset` dispatches on the name, by substring as the
reference):

* hub names (``Dahoas/rm-static`` ... ``lmqg/qag_jaquad``, see ``HUB_DATASETS`` in
  :mod:`utils.data.hub_datasets`): loaded with ``datasets.load_dataset`` on first use;
  a name that is also an existing local path is read from disk instead, as the
  reference does;
* ``local/jsonfile``: ``data/train.json`` and ``data/eval.json`` relative to the
  current directory (:mod:`utils.data.local_datasets`);
* any existing local path: a data file, a ``datasets.save_to_disk`` folder, or a folder
  of train/eval files (formats and row layouts: :mod:`utils.data.local_datasets`);
* ``builtin/...`` (:mod:`utils.data.builtin`), generated locally.
"""
from __future__ import annotations

import os

from utils.data.hub_datasets import HUB_DATASETS
from utils.data.local_datasets import BuiltinDataset, LocalJsonFileDataset, LocalPathDataset
from utils.errors import UserInputError


# --------------------------------------------------------------------------- dispatch
def supported_names():
    """The names :func:`get_raw_dataset` understands (besides local paths)."""
    names = [name for name, _ in HUB_DATASETS] + ["local/jsonfile"]
    try:
        from utils.data import builtin
        names += list(builtin.BUILTIN_DATASETS)
    except ImportError:  # pragma: no cover
        names.append("builtin/...")
    return names


def from_hub(dataset_name: str) -> bool:
    """Whether :func:`get_raw_dataset` would fetch ``dataset_name`` from the Hugging Face hub (a hub name that is not
    also a local path)."""
    if dataset_name.startswith("builtin/") or "local/jsonfile" in dataset_name:
        return False
    return any(key in dataset_name for key, _ in HUB_DATASETS) and not os.path.exists(os.path.expanduser(dataset_name))


def get_raw_dataset(dataset_name, output_path, seed, local_rank):
    """The adapter for ``dataset_name`` (no data are read yet; see the module docstring)."""
    if not isinstance(dataset_name, str) or not dataset_name.strip():
        raise UserInputError(f"dataset {dataset_name!r}: empty dataset name")
    if dataset_name.startswith("builtin/"):
        return BuiltinDataset(output_path, seed, local_rank, dataset_name)
    if "local/jsonfile" in dataset_name:
        return LocalJsonFileDataset(output_path, seed, local_rank, dataset_name)
    for key, cls in HUB_DATASETS:
        if key in dataset_name:
            return cls(output_path, seed, local_rank, dataset_name)
    if os.path.exists(os.path.expanduser(dataset_name)):
        return LocalPathDataset(output_path, seed, local_rank, dataset_name)
    raise UserInputError(
        f"dataset {dataset_name!r}: not a supported dataset name, and no local path "
        f"{os.path.abspath(os.path.expanduser(dataset_name))} exists. Supported names: "
        + ", ".join(supported_names())
        + "; or a local path, which must exist (a .json/.jsonl/.jsonl.gz/.json.gz/.parquet file, "
        "a datasets.save_to_disk folder, or a folder with train/eval files)")
