"""An FSDP2 (``fully_shard``) backbone with a ClassParallelHead beside it.

    torchrun --nproc_per_node 2 examples/fsdp_head.py
"""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common import backbone, head_and_optimizer, init_process_group, local_batch, parse_args, report

args = parse_args(__doc__)
rank, world = init_process_group()
model = backbone()
fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # parameters become shards; gradients averaged
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # over the shards
head, head_opt = head_and_optimizer(args)  # not sharded by FSDP: its classes are already split

losses = []
for step in range(args.steps):
    x, y = local_batch(step, args, rank, world)
    loss = head(model(x), y)
    loss.backward()           # FSDP reduce-scatters the backbone's gradients; the head's stay local
    opt.step(), head_opt.step()
    opt.zero_grad(), head_opt.zero_grad()
    losses.append(loss.item())
report(rank, losses, args)
