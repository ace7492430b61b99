"""A small decoder-only language model whose output layer is the ds_xc head, trained under DeepSpeed.

    deepspeed examples/language_model.py                  # one process on a CPU: about a minute on 2 cores
    deepspeed --num_gpus 2 examples/language_model.py     # two ranks: the vocabulary sharded over them

Data: the built-in text data (ds_xc.data.TextDataset: the words of the Python standard library's
sources, already on every machine, nothing downloaded). The vocabulary, ``--vocab`` words (<unk> = 0
and the most frequent words), is the head's classes. A sample is a window of ``--context`` words and
the word after it; the model reads the window and predicts the next word at every position, so a
batch is B windows of T tokens: embeddings (B, T, d) and labels (B, T). Targets that are padding
(positions before a file's first word) or <unk> are -100, which the loss ignores
(``ignore_index``); the loss smooths the labels (``--label_smoothing``, default 0.1, over the whole
vocabulary, exact across the ranks that share it).

The model: token and position embeddings, ``--layers`` pre-norm causal self-attention blocks
(torch.nn.TransformerEncoderLayer with a causal mask), a final LayerNorm; ``ds_xc.initialize`` wraps
it in the DeepSpeed engine and builds the ClassParallelHead and its optimizer from the config's
``extreme_classification`` section. At the end rank 0 prints the held-out next-token accuracy: the
word after each held-out window (files never trained on), top-1 and top-5 over the whole vocabulary.
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import ds_xc
from ds_xc.data import TextDataset
from ds_xc.engine import init_distributed
from ds_xc.evaluate import evaluate_topk

IGNORE = -100


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=4096, help="words in the vocabulary: the head's classes")
    p.add_argument("--context", type=int, default=16, help="tokens per sequence T")
    p.add_argument("--batch", type=int, default=32, help="sequences per rank and step")
    p.add_argument("--dim", type=int, default=128, help="model width d (the head's embedding_dim)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--label_smoothing", type=float, default=0.1)
    p.add_argument("--eval_samples", type=int, default=4096, help="held-out words to score at the end")
    p.add_argument("--text_root", default=None, help="folder of .py files (default: the standard library)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="rank 0 writes the losses and the accuracy here (JSON)")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))  # the deepspeed launcher's
    return p.parse_args()


class DecoderLM(nn.Module):
    """(B, T) token ids -> (B, T, dim) hidden states: token + position embeddings, causal pre-norm
    self-attention blocks, a final LayerNorm. The ds_xc head is its output layer."""

    def __init__(self, input_vocab: int, context: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(input_vocab, dim)
        self.pos = nn.Embedding(context, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        t = tokens_BT.shape[1]
        h_BTD = self.tok(tokens_BT) + self.pos.weight[:t]
        h_BTD = self.blocks(h_BTD, mask=self.causal[:t, :t], is_causal=True)
        return self.norm(h_BTD)


def sequences(data: TextDataset, step: int, batch: int, rank: int, world: int):
    """This rank's (B, T) input tokens and (B, T) next-token targets of the step's global batch: the
    window's tokens shifted by one, then the word after it; padding and <unk> targets -> IGNORE."""
    tokens_BT, next_B = data.train_batch(step, batch, rank, world)
    targets_BT = torch.cat([tokens_BT[:, 1:], next_B[:, None]], dim=1)
    targets_BT = targets_BT.masked_fill((targets_BT == data.pad_id) | (targets_BT == 0), IGNORE)
    return tokens_BT, targets_BT


def load_text(args, rank: int) -> TextDataset:
    """Rank 0 tokenises (and caches) the text first; the others then read its cache."""
    if rank != 0:
        dist.barrier()
    data = TextDataset(args.vocab, context=args.context, seed=args.seed, root=args.text_root)
    if rank == 0:
        dist.barrier()
    return data


def config(args, num_classes: int) -> dict:
    loss = {"type": "softmax", "ignore_index": IGNORE, "label_smoothing": args.label_smoothing}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
        "extreme_classification": {
            "num_classes": num_classes, "embedding_dim": args.dim, "loss": loss, "seed": args.seed,
            "optimizer": {"type": "adamw", "lr": args.lr, "weight_decay": 0.0, "update": "dense"},
        },
    }


def main() -> None:
    args = parse_args()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if "OMP_NUM_THREADS" not in os.environ:  # the deepspeed launcher sets none: one thread per rank, as the
        torch.set_num_threads(1)  # model is small (2 threads on 2 busy cores were 10x slower, spinning)
    init_distributed()  # the launcher's group, or one process without a launcher
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_text(args, rank)
    torch.manual_seed(args.seed)  # the same replica on every rank
    model = DecoderLM(data.input_dim, args.context, args.dim, args.layers, args.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    xc = ds_xc.initialize(model=model, optimizer=opt, config=config(args, data.num_label_classes))
    if rank == 0:
        print(f"{world} rank(s): vocabulary {data.num_label_classes} words (the head's classes), context "
              f"{args.context}, {sum(p.numel() for p in model.parameters()):,} backbone parameters; loss "
              f"ignore_index {IGNORE}, label_smoothing {args.label_smoothing}", flush=True)
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        tokens, targets = sequences(data, step, args.batch, rank, world)  # (B, T), (B, T)
        loss = xc(tokens, targets)  # the head: (B, T, d) and (B, T) labels, -100 ignored
        xc.backward(loss)
        xc.step()
        losses.append(loss.item())
        if rank == 0 and (step % 50 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    batches = data.eval_batches(args.batch, rank, world, max_samples=args.eval_samples)
    acc = evaluate_topk(lambda t: xc.engine(t)[:, -1], xc.head, batches, ks=(1, 5))  # the last position's word
    if rank == 0:
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps")
        print(f"held-out next-token accuracy: top-1 {acc['top1']:.4f}, top-5 {acc['top5']:.4f} "
              f"over {acc['samples']} words of files never trained on")
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(dict(losses=losses, world_size=world, **acc), fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
