"""DeepSpeed: ``ds_xc.initialize`` builds the engine for the backbone, the ClassParallelHead and its
optimizer from one config (the JSON's ``extreme_classification`` section); the same model and
data as the other examples.

    torchrun --nproc_per_node 2 examples/deepspeed_head.py     (or: deepspeed --num_gpus 2 ...)
"""
import torch

import ds_xc
from common import D, backbone, init_process_group, local_batch, parse_args, report

args = parse_args(__doc__)
rank, world = init_process_group()
config = {
    "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: the ranks' batches are uneven here
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,  # DeepSpeed 0.19 clips at 1.0 unless told; the other examples do not clip
    "zero_optimization": {"stage": 0},
    "extreme_classification": {
        "num_classes": args.classes, "embedding_dim": D, "loss": {"type": "cosface"},
        "optimizer": {"type": "sgd", "lr": args.lr, "momentum": 0.9, "update": "dense"},
    },
}
model = backbone()
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
xc = ds_xc.initialize(model=model, optimizer=opt, config=config)  # engine + head shard + head optimizer

losses = []
for step in range(args.steps):
    x, y = local_batch(step, args, rank, world)
    loss = xc(x, y)      # backbone (the engine) -> the head over the global batch
    xc.backward(loss)    # the engine averages the backbone's gradients; the head's stay local
    xc.step()            # the head's optimizer, then the engine's
    losses.append(loss.item())
report(rank, losses, args)
