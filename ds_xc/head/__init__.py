"""The class-parallel head: class split, margin losses, sharded fused softmax, optimizers."""
from ds_xc.head.head import ClassParallelHead, init_shard
from ds_xc.head.margins import build_loss
from ds_xc.head.optim import HeadAdamW, HeadSGD, build_head_optimizer
from ds_xc.head.partition import owner_of, shard_range, shard_sizes
from ds_xc.head.softmax import sharded_margin_loss

__all__ = ["ClassParallelHead", "init_shard", "build_loss", "HeadSGD", "HeadAdamW",
           "build_head_optimizer", "shard_range", "shard_sizes", "owner_of", "sharded_margin_loss"]
