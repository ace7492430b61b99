"""InsightFace arcface_torch's train_v2.py loop, ported to ds_xc (the mapping: docs/from_partial_fc.md).

arcface_torch trains a backbone and PartialFC_V2 (CombinedMarginLoss, scale 64) with one SGD over
both, its PolynomialLRWarmup schedule stepped after every batch, the backbone's gradients clipped to
norm 5 and, per epoch, one checkpoint per rank (checkpoint_gpu_{rank}.pt with the softmax weight
shard). Here DeepSpeed runs the backbone (its gradient clipping, the client SGD and schedule passed to
``ds_xc.initialize`` as arcface_torch builds them), ds_xc's ClassParallelHead replaces PartialFC_V2
(the same class shards), its SGD follows the schedule (``lr_schedule: follow_engine``), and
``xc.save_checkpoint`` writes the per-rank shards. The data is ds_xc's built-in synthetic set, the
backbone a small MLP: nothing is downloaded. About a minute on one CPU core with the defaults:

    python examples/arcface_torch_port.py                 # one process
    deepspeed examples/arcface_torch_port.py              # DeepSpeed's launcher (gloo on a CPU machine)
    torchrun --nproc_per_node 2 examples/arcface_torch_port.py
    python examples/arcface_torch_port.py --resume        # continue from --output's latest checkpoint
"""
import argparse
import json
import os

import torch
import torch.distributed as dist

import ds_xc
from ds_xc.data import build_dataset
from ds_xc.evaluate import evaluate_topk


class PolynomialWarmup(torch.optim.lr_scheduler.LRScheduler):
    """arcface_torch's PolynomialLRWarmup, restated in closed form (t = the scheduler's step count):

    lr(0) = base (the optimizer's lr is left as it is when the scheduler is built), lr(t) = base * t / w
    for 1 <= t <= w, lr(t) = base * (1 - (min(t, T) - w) / (T - w)) ** power for t > w
    (w = warmup_iters, T = total_iters); 0 from T on. DeepSpeed steps it after every optimizer step.
    """

    def __init__(self, optimizer, warmup_iters: int, total_iters: int, power: float, last_epoch: int = -1):
        if not 0 <= warmup_iters < total_iters:
            raise ValueError(f"warmup_iters={warmup_iters}, total_iters={total_iters}: need 0 <= warmup < total")
        self.warmup_iters, self.total_iters, self.power = warmup_iters, total_iters, power
        super().__init__(optimizer, last_epoch)

    def factor(self, t: int) -> float:
        if t == 0:
            return 1.0
        if t <= self.warmup_iters:
            return t / self.warmup_iters
        return (1.0 - (min(t, self.total_iters) - self.warmup_iters) / (self.total_iters - self.warmup_iters)) \
            ** self.power

    def get_lr(self):
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]


class Backbone(torch.nn.Module):
    """(B, input_dim) -> (B, embedding_size): Linear-BN-PReLU, then a Linear and BatchNorm1d feature
    layer as iresnet's output (a stand-in for the r50 of ``config.network``)."""

    def __init__(self, input_dim: int, embedding_size: int, hidden: int = 256):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(input_dim, hidden), torch.nn.BatchNorm1d(hidden),
                                        torch.nn.PReLU(hidden), torch.nn.Linear(hidden, embedding_size))
        self.features = torch.nn.BatchNorm1d(embedding_size)

    def forward(self, x):
        return self.features(self.body(x))


def margin_loss(margin_list, scale: float) -> dict:
    """CombinedMarginLoss(s, m1, m2, m3) as ds_xc's loss section: arcface_torch computes
    s cos(theta + m2) when m1 == 1 and m3 == 0, s (cos - m3) when m3 > 0 (m1, m2 then unused) and raises
    otherwise; ds_xc's combined loss s (cos(m1 theta + m2) - m3) is each of those."""
    m1, m2, m3 = margin_list
    if m3 > 0:
        m1, m2 = 1.0, 0.0
    return {"type": "combined", "scale": scale, "m1": m1, "m2": m2, "m3": m3}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument  # arcface_torch's config names (configs/base.py); the defaults are small
    a("--margin_list", type=lambda s: tuple(float(v) for v in s.split(",")), default=(1.0, 0.5, 0.0))
    a("--scale", type=float, default=64.0, help="train_v2.py's CombinedMarginLoss(64, ...)")
    a("--embedding_size", type=int, default=64)
    a("--num_classes", type=int, default=1000)
    a("--sample_rate", type=float, default=1.0)
    a("--interclass_filtering_threshold", type=float, default=0.0, help="0 only (docs/from_partial_fc.md)")
    a("--fp16", action="store_true", help="DeepSpeed bf16 for the backbone (ds_xc refuses fp16 loss scaling)")
    a("--batch_size", type=int, default=64, help="per rank")
    a("--optimizer", choices=("sgd", "adamw"), default="sgd")
    a("--lr", type=float, default=0.1)
    a("--momentum", type=float, default=0.9)
    a("--weight_decay", type=float, default=5e-4)
    a("--num_image", type=int, default=4096, help="samples per epoch")
    a("--num_epoch", type=int, default=4)
    a("--warmup_epoch", type=int, default=1)
    a("--power", type=float, default=2.0, help="decay power (PolynomialLRWarmup's default is 1.0)")
    a("--gradient_acc", type=int, default=1)
    a("--clip_grad_norm", type=float, default=5.0, help="train_v2.py's clip_grad_norm_(backbone, 5)")
    a("--seed", type=int, default=2048)
    a("--output", default="arcface_port_output")
    a("--save_all_states", action=argparse.BooleanOptionalAction, default=True)
    a("--resume", action="store_true")
    a("--frequent", type=int, default=10, help="print every N steps (rank 0)")
    a("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: all epochs)")
    a("--out", default=None, help="rank 0 writes the per-step lrs and losses here (JSON)")
    a("--local_rank", type=int, default=0, help="set by the deepspeed launcher; the rank comes from the env")
    args = p.parse_args()
    if args.interclass_filtering_threshold != 0:
        p.error(f"--interclass_filtering_threshold={args.interclass_filtering_threshold}: ds_xc has no inter-class "
                "filtering; allowed: 0 (docs/from_partial_fc.md says what to use instead)")
    if len(args.margin_list) != 3:
        p.error(f"--margin_list={args.margin_list}: expected three numbers m1,m2,m3")
    return args


def main():
    args = parse_args()
    data = build_dataset("synthetic", args.num_classes, seed=args.seed)
    torch.manual_seed(args.seed)  # the same backbone on every rank
    backbone = Backbone(data.input_dim, args.embedding_size)
    if args.fp16:  # DeepSpeed's bf16 casts the parameters; the BatchNorm statistics too, here
        backbone.to(torch.bfloat16)
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(backbone.parameters(), lr=args.lr, momentum=args.momentum,
                              weight_decay=args.weight_decay)
    else:
        opt = torch.optim.AdamW(backbone.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    config = {
        "train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.gradient_acc,
        "gradient_clipping": args.clip_grad_norm, "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
        "bf16": {"enabled": args.fp16},
        "extreme_classification": {
            "num_classes": args.num_classes, "embedding_dim": args.embedding_size, "seed": args.seed,
            "loss": margin_loss(args.margin_list, args.scale),
            "sampler": {"type": "full"} if args.sample_rate >= 1 else {"type": "uniform",
                                                                        "sample_rate": args.sample_rate},
            "optimizer": {"type": args.optimizer, "lr": args.lr, "momentum": args.momentum,
                          "weight_decay": args.weight_decay, "lr_schedule": "follow_engine"}},
    }
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the launcher's; ds_xc.initialize starts the group
    steps_per_epoch = args.num_image // (args.batch_size * world * args.gradient_acc)  # optimizer steps
    if steps_per_epoch < 1 or not 0 <= args.warmup_epoch < args.num_epoch:  # every rank alike, before a collective
        raise SystemExit(f"--num_image={args.num_image} // (--batch_size={args.batch_size} x {world} ranks x "
                         f"--gradient_acc={args.gradient_acc}) = {steps_per_epoch} steps per epoch, --warmup_epoch="
                         f"{args.warmup_epoch}, --num_epoch={args.num_epoch}: need >= 1 step per epoch and "
                         "0 <= warmup_epoch < num_epoch")
    warmup_step, total_step = steps_per_epoch * args.warmup_epoch, steps_per_epoch * args.num_epoch
    scheduler = PolynomialWarmup(opt, warmup_step, total_step, args.power)
    xc = ds_xc.initialize(model=backbone, optimizer=opt, lr_scheduler=scheduler, config=config)
    rank, world = dist.get_rank(), dist.get_world_size()

    start_epoch = global_step = 0
    if args.resume:
        state = xc.load_checkpoint(args.output)  # every rank's head shard, the engine, the schedule
        if state is not None:
            start_epoch, global_step = state["epoch"], state["global_step"]
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"{args.num_classes} classes on {world} rank(s), {steps_per_epoch} steps per epoch, warm-up {warmup_step} "
        f"of {total_step} steps, loss {config['extreme_classification']['loss']}")
    record = {"lr_backbone": [], "lr_head": [], "loss": [], "steps": [], "world_size": world,
              "warmup_step": warmup_step, "total_step": total_step, "lr": args.lr, "power": args.power}
    for epoch in range(start_epoch, args.num_epoch):
        for _ in range(steps_per_epoch):
            if args.max_steps and global_step >= args.max_steps:
                break
            lr_backbone = float(xc.engine.get_lr()[0])  # this step's (DeepSpeed steps the schedule after it)
            losses = []
            for micro in range(args.gradient_acc):
                x, y = data.train_batch(global_step * args.gradient_acc + micro, args.batch_size, rank, world)
                x, y = x.to(xc.engine.device), y.to(xc.engine.device)  # the rank's GPU under a GPU launcher
                x = x.to(torch.bfloat16) if args.fp16 else x  # DeepSpeed's bf16 backbone takes bf16 inputs
                losses.append(float(xc.forward_backward(x, y)))
                xc.step()  # at the accumulation boundary: the head (lr following the schedule), then DeepSpeed
            global_step += 1
            record["lr_backbone"].append(lr_backbone)
            record["lr_head"].append(float(xc.head_optimizer.param_groups[0]["lr"]))
            record["loss"].append(sum(losses) / len(losses))
            record["steps"].append(global_step)
            if global_step % args.frequent == 0:
                say(f"epoch {epoch} step {global_step}/{total_step} loss {record['loss'][-1]:.4f} "
                    f"lr {lr_backbone:.6f} head lr {record['lr_head'][-1]:.6f}")
        if args.save_all_states and global_step % steps_per_epoch == 0:  # a whole epoch: arcface_torch's save
            xc.save_checkpoint(args.output, tag=f"epoch_{epoch + 1}",
                               client_state={"epoch": epoch + 1, "global_step": global_step})
            if rank == 0:
                torch.save(xc.engine.module.state_dict(), f"{args.output}/model.pt")  # the backbone, as model.pt
        if args.max_steps and global_step >= args.max_steps:
            break
    xc.eval()
    embed = (lambda x: xc.engine(x.to(torch.bfloat16))) if args.fp16 else xc.engine
    res = evaluate_topk(embed, xc.head, data.eval_batches(args.batch_size, rank, world, 2048),
                        device=xc.engine.device)
    if record["loss"]:
        say(f"loss {record['loss'][0]:.4f} -> {record['loss'][-1]:.4f} over {len(record['loss'])} steps; "
            f"held-out top-1 {res['top1']:.4f}")
    if rank == 0 and args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(record, top1=res["top1"]), fh)


if __name__ == "__main__":
    main()
