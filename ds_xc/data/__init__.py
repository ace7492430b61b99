"""Built-in data sets: synthetic (any number of classes) and text (stdlib next word).

``build_dataset(name, num_classes, seed=0, **kwargs)`` builds one by registry name;
every data set implements ``XCDataset`` (see base.py for the resume contract).
"""

from __future__ import annotations

from ds_xc.data.base import XCDataset
from ds_xc.data.synthetic import SyntheticDataset
from ds_xc.data.text import TextDataset

DATASETS: dict[str, type[XCDataset]] = {"synthetic": SyntheticDataset, "text": TextDataset}


def build_dataset(name: str, num_classes: int, seed: int = 0, **kwargs) -> XCDataset:
    """The data set registered as ``name``; ``kwargs`` go to its constructor."""
    if name not in DATASETS:
        raise ValueError(f"dataset name={name!r} is invalid: allowed {sorted(DATASETS)}")
    return DATASETS[name](num_classes, seed=seed, **kwargs)


__all__ = ["DATASETS", "SyntheticDataset", "TextDataset", "XCDataset", "build_dataset"]
