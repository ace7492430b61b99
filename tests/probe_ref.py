"""The reference of the accuracy probe's tests (tests/test_tune.py, test_tune_probe.py,
test_tune_dist.py): a head trained by hand in one process, step by step, and scored in float64."""
import torch


def trained_weight(section, batch, steps):
    """(C, d) float64: the weights of ``section``'s head after ``steps`` steps on ``batch(i)`` ->
    (x, y), trained by hand with its own optimizer."""
    from ds_xc.head import ClassParallelHead, build_head_optimizer
    head = ClassParallelHead.from_config(section)
    opt = build_head_optimizer(head, section["optimizer"])
    for i in range(steps):
        x, y = batch(i)
        head(x.detach().requires_grad_(True), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return head.weight.detach().double()


def top1_hits(w, held):
    """(samples,) bool: whether argmax x.w is the label, over the held-out (x, y) batches."""
    return torch.cat([(x.double() @ w.T).argmax(dim=1) == y for x, y in held])


def topk_counts(w, held, k=5):
    """(top-1 hits, top-k hits, samples) of x.w over the held-out (x, y) batches."""
    hits1 = hitsk = n = 0
    for x, y in held:
        top = (x.double() @ w.T).topk(k, dim=1).indices
        hits1 += int((top[:, 0] == y).sum())
        hitsk += int((top == y[:, None]).any(dim=1).sum())
        n += y.numel()
    return hits1, hitsk, n
