"""Plain torch.distributed: a ClassParallelHead and a backbone whose gradients CompressedOptimizer
averages over the ranks (``--compress none``: a dense all-reduce), no DDP, no DeepSpeed.

    torchrun --nproc_per_node 2 examples/torch_head.py
    torchrun --nproc_per_node 2 examples/torch_head.py --compress bayes_prior
"""
import torch

import ds_xc
from common import backbone, head_and_optimizer, init_process_group, local_batch, parse_args, report

args = parse_args(__doc__, compress=dict(default="none", choices=["none", "bayes_prior", "topk", "randomk"]),
                  density=dict(type=float, default=0.05))
rank, world = init_process_group()
model = backbone()  # a replica per rank
opt = ds_xc.CompressedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                {"method": args.compress, "density": args.density, "min_numel": 256})
head, head_opt = head_and_optimizer(args)

losses = []
for step in range(args.steps):
    x, y = local_batch(step, args, rank, world)
    loss = head(model(x), y)
    loss.backward()
    opt.step()       # the backbone's gradients: (compressed) mean over the ranks, then SGD
    head_opt.step()  # the head's shard: its own gradient, never averaged
    opt.zero_grad(), head_opt.zero_grad()
    losses.append(loss.item())
report(rank, losses, args, compress=args.compress, density=opt.stats()["global_density"])
