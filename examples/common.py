"""What the examples share: the process group, a synthetic global batch, the backbone and the head.

Each example trains the same backbone + ClassParallelHead on the same global batches, only
the backbone's data-parallel wrapper differs; so their losses agree, with each other and
with one process (``python examples/X.py``) up to float32 rounding.
"""
import argparse
import json
import os
import socket

import torch
import torch.distributed as dist

import ds_xc

IN, D = 32, 16  # input features, embedding dim


def parse_args(description: str, **extra) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--classes", type=int, default=101, help="num_classes (need not divide by the ranks)")
    p.add_argument("--batch", type=int, default=67, help="global batch (split unevenly over the ranks)")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--out", default=None, help="rank 0 writes the losses here (JSON)")
    for flag, kwargs in extra.items():
        p.add_argument(f"--{flag}", **kwargs)
    return p.parse_args()


def init_process_group() -> tuple[int, int]:
    """gloo from torchrun's environment, or one process without a launcher (as torchrun would set it); the
    rank's GPU (if any) bound first."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ds_xc.bind_device()  # cuda:LOCAL_RANK on a GPU host (logged), before the first collective; the CPU here
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    return dist.get_rank(), dist.get_world_size()


def local_batch(step: int, args, rank: int, world: int):
    """This rank's rows of the step's global batch: x (B_r, IN), y (B_r,) global class ids."""
    g = torch.Generator().manual_seed(12345)
    prototypes = torch.randn(args.classes, IN, generator=g)  # (C, IN) one centre per class
    g.manual_seed(step)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    x = prototypes[y] + 0.5 * torch.randn(args.batch, IN, generator=g)  # (N, IN)
    rows = torch.tensor_split(torch.arange(args.batch), world)[rank]  # uneven when N % P != 0
    return x[rows], y[rows]


def backbone() -> torch.nn.Module:
    torch.manual_seed(0)  # the same replica on every rank
    return torch.nn.Sequential(torch.nn.Linear(IN, 64), torch.nn.ReLU(), torch.nn.Linear(64, D))


def head_and_optimizer(args):
    """The class-parallel head over the world (never inside DDP/FSDP) and ds_xc's head optimizer."""
    head = ds_xc.ClassParallelHead(embedding_dim=D, num_classes=args.classes, loss="cosface", group=None)
    head_opt = ds_xc.build_head_optimizer(head, {"type": "sgd", "lr": args.lr, "momentum": 0.9, "update": "dense"})
    return head, head_opt


def report(rank: int, losses: list, args, **extra) -> None:
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(dict(losses=losses, world_size=dist.get_world_size(), **extra), fh)
    dist.destroy_process_group()
