"""The head's checkpoint fingerprint (ds_xc/head/head.py: _checksum) without copies of the shard.

``state_dict()`` and ``load_state_dict()`` fingerprint the weight shard (sum, sum of squares in
float64) so that an index saved with other weights is never used. The fingerprint equals the float64
reference, still tells changed weights apart, and its peak extra memory (the process's VmHWM, reset
before the call, less the resident set before it) is at most 1.25x the shard's bytes, for float32
and bfloat16 shards of ~100 MB, in one process and on 2 and 3 gloo ranks (uneven shards). A float64
copy and its square, as before, were 16 bytes per element: 4x a float32 shard's bytes, 8x a bfloat16's.
"""
import pytest
import torch

import ds_xc
from ds_xc.head.head import _checksum
from ds_xc.tune.measure import hwm_bytes, release_free_memory, reset_peak, rss_bytes

C, D = 3 * (1 << 17) + 1, 128  # ~201 MB of float32 over the ranks; uneven for 2 and 3
BUDGET = 1.25


def test_fingerprint_is_the_float64_sum_and_sum_of_squares():
    gen = torch.Generator().manual_seed(0)
    for shape, dtype in (((1001, 33), torch.float32), ((70, 5), torch.bfloat16), ((9, 4), torch.float64),
                         ((0, 4), torch.float32)):
        w = torch.randn(shape, generator=gen).to(dtype)
        ref = w.double()
        total, squares = _checksum(w)
        assert total == pytest.approx(float(ref.sum()), rel=1e-12, abs=1e-12)
        assert squares == pytest.approx(float((ref * ref).sum()), rel=1e-12, abs=1e-12)
        if w.numel():
            changed = w.clone()
            changed[-1, -1] += 1.0
            assert _checksum(changed) != _checksum(w)


def _peak_extra(fn) -> int:
    release_free_memory()
    base = rss_bytes()
    reset_peak()
    fn()
    return hwm_bytes() - base


def _measure(rank, world, dtype):
    """(shard bytes, peak extra bytes of state_dict(), of load_state_dict()) on this rank."""
    torch.manual_seed(0)
    head = ds_xc.ClassParallelHead(D, C, dtype=dtype, check_inputs=False)
    shard = head.weight.numel() * head.weight.element_size()
    box = {}
    saved = _peak_extra(lambda: box.update(sd=head.state_dict()))
    loaded = _peak_extra(lambda: head.load_state_dict(box["sd"]))
    assert box["sd"]["_extra_state"]["weight_checksum"] == _checksum(head.weight)
    return shard, saved, loaded


def _check(results):
    for shard, saved, loaded in results:
        assert saved <= BUDGET * shard, f"state_dict(): {saved / shard:.2f}x the shard's {shard} bytes"
        assert loaded <= BUDGET * shard, f"load_state_dict(): {loaded / shard:.2f}x the shard's {shard} bytes"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_state_dict_peak_memory_one_process(dtype):
    _check([_measure(0, 1, dtype)])


@pytest.mark.parametrize("world", [2, 3])
def test_state_dict_peak_memory_on_ranks(pools, world):
    _check(pools(world).run(_measure, "bfloat16"))
