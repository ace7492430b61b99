"""Built-in data sets: synthetic (any number of classes), text (stdlib next word),
corpus (next word or word pair over Debian's dictionary and documentation) and glyphs
(CJK characters rendered from Debian fonts, verified on held-out fonts).

``build_dataset(name, num_classes, seed=0, **kwargs)`` builds one by registry name;
every data set implements ``XCDataset`` (see base.py for the resume contract).
"""

from __future__ import annotations

from ds_xc.data.base import XCDataset
from ds_xc.data.corpus import CorpusDataset
from ds_xc.data.glyphs import GlyphDataset
from ds_xc.data.synthetic import SyntheticDataset
from ds_xc.data.text import TextDataset

DATASETS: dict[str, type[XCDataset]] = {
    "synthetic": SyntheticDataset, "text": TextDataset, "corpus": CorpusDataset, "glyphs": GlyphDataset}


def dataset_kwargs(train) -> dict:
    """The constructor arguments that an ``xc_train`` section (ds_xc.config.TrainConfig) gives
    its data set, besides num_classes and seed: the context and label mode of text and corpus."""
    if train.data == "text":
        return {"context": train.context, "mode": train.text_mode, "vocab_size": train.text_vocab_size or None}
    if train.data == "corpus":
        return {"context": train.context, "mode": train.corpus_mode, "vocab_size": train.corpus_vocab_size or None}
    return {}


def build_dataset(name: str, num_classes: int, seed: int = 0, **kwargs) -> XCDataset:
    """The data set registered as ``name``; ``kwargs`` go to its constructor."""
    if name not in DATASETS:
        raise ValueError(f"dataset name={name!r} is invalid: allowed {sorted(DATASETS)}")
    return DATASETS[name](num_classes, seed=seed, **kwargs)


def build_task_data(train, num_classes: int, *, rank: int, group) -> XCDataset:
    """The data set an ``xc_train`` section names, built by rank 0 of ``group`` first (it fills
    any cache on disk: tokenised text, rendered glyphs, fetched corpus), then by the other ranks,
    which then read that cache instead of all building it at once."""
    import torch.distributed as dist

    if rank != 0:
        dist.barrier(group=group)
    data = build_dataset(train.data, num_classes, seed=train.seed, **dataset_kwargs(train))
    if rank == 0:
        dist.barrier(group=group)
    return data


__all__ = ["DATASETS", "CorpusDataset", "GlyphDataset", "SyntheticDataset", "TextDataset", "XCDataset",
           "build_dataset", "build_task_data", "dataset_kwargs"]
