"""Random inverted files for the Hamming-scan tests (tests/test_ops_hamming.py for the C++,
CUDA and faiss backends, tests/test_triton_hamming.py for the Triton kernel)."""
import torch


def random_ivf(seed, bits, n, rows, nlist, nprobe, distinct=None, id_scale=3, id_offset=5):
    """(q, list_codes, list_ids, list_offsets, probes) on the CPU; with ``distinct`` the codes
    come from a small pool (many equal distances, ties resolved by id); ids are not row numbers."""
    g = torch.Generator().manual_seed(seed)
    nbytes = bits // 8
    if distinct:
        pool = torch.randint(0, 256, (distinct, nbytes), dtype=torch.uint8, generator=g)
        codes = pool[torch.randint(0, distinct, (rows,), generator=g)]
        q = pool[torch.randint(0, distinct, (n,), generator=g)]
    else:
        codes = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
        q = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)
    assign = torch.randint(0, nlist, (rows,), generator=g)
    order = torch.sort(assign, stable=True).indices
    ids = torch.randperm(rows, generator=g)[order] * id_scale + id_offset
    offsets = torch.zeros(nlist + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(assign, minlength=nlist).cumsum(0)
    probes = torch.randint(0, nlist, (n, nprobe), generator=g)
    return q, codes[order].contiguous(), ids, offsets, probes
