"""A DDP backbone with a ClassParallelHead beside it; optionally ds_xc's compressed reduction as
DDP's communication hook.

    torchrun --nproc_per_node 2 examples/ddp_head.py
    torchrun --nproc_per_node 2 examples/ddp_head.py --compress topk --density 0.05
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ds_xc
from common import backbone, head_and_optimizer, init_process_group, local_batch, parse_args, report

args = parse_args(__doc__, compress=dict(default="none", choices=["none", "bayes_prior", "topk", "randomk"]),
                  density=dict(type=float, default=0.05))
rank, world = init_process_group()
model = DDP(backbone())  # the backbone's gradients: averaged over the ranks by DDP
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
hook = None
if args.compress != "none":
    hook = ds_xc.CompressedDDPHook(model, opt, {"method": args.compress, "density": args.density, "min_numel": 256})
    model.register_comm_hook(hook, ds_xc.compressed_ddp_hook)  # each bucket: compressed mean, error feedback
head, head_opt = head_and_optimizer(args)  # outside DDP: its shard differs on every rank

losses = []
for step in range(args.steps):
    x, y = local_batch(step, args, rank, world)
    loss = head(model(x), y)  # the global batch's mean loss, the same on every rank
    loss.backward()           # DDP reduces the backbone's gradients; the head's stay local
    opt.step(), head_opt.step()
    opt.zero_grad(), head_opt.zero_grad()
    losses.append(loss.item())
report(rank, losses, args, compress=args.compress,
       density=hook.stats()["global_density"] if hook is not None else 1.0)
