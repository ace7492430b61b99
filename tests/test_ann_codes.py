"""The ANN codes' projection precision (``code_precision``): bfloat16 codes are the signs of the bf16
matmul, close to float32's; "auto" resolves by the device; tracking (dense updates) keeps float32."""
import pytest
import torch

from ds_xc.config import ConfigError, parse_config
from ds_xc.sampling.ann import codes as C
from ds_xc.sampling.ann.index import AnnIndex
from ds_xc_ops.hamming import unpack_bits


def test_bfloat16_codes_are_the_signs_of_the_bf16_matmul():
    g = torch.Generator().manual_seed(0)
    x, p = torch.randn(3000, 64, generator=g), C.random_projection(64, 256, 1)
    low = C.encode(x, p, chunk=1000, precision="bfloat16")
    want = C.pack((x.bfloat16() @ p.bfloat16()).float())
    assert torch.equal(low, want)
    full = C.encode(x, p)
    assert torch.equal(full, C.pack(x @ p))
    differ = (unpack_bits(low) != unpack_bits(full)).float().mean().item()
    assert 0.0 < differ < 0.01  # a few bits nearest a sign boundary


def test_resolve_precision(monkeypatch):
    cpu = torch.device("cpu")
    assert C.resolve_precision("float32", cpu) == "float32" and C.resolve_precision("bfloat16", cpu) == "bfloat16"
    monkeypatch.setattr(C, "_CPU_BF16", [True])
    assert C.resolve_precision("auto", cpu) == "bfloat16"
    monkeypatch.setattr(C, "_CPU_BF16", [False])
    assert C.resolve_precision("auto", cpu) == "float32"
    with pytest.raises(ValueError, match="code_precision='half'"):
        C.resolve_precision("half", cpu)
    with pytest.raises(ValueError, match="code_precision"):
        AnnIndex(8, 64, code_precision="fp8")


def test_config_names_the_field():
    sec = {"num_classes": 100, "embedding_dim": 8, "sampler": {"type": "ann", "code_precision": "fp16"}}
    with pytest.raises(ConfigError, match="code_precision"):
        parse_config({"extreme_classification": sec})
    sec["sampler"]["code_precision"] = "bfloat16"
    assert parse_config({"extreme_classification": sec}).extreme_classification.sampler.code_precision == "bfloat16"


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_index_encodes_untracked_rows_and_queries_in_its_precision_and_tracked_rows_in_float32(precision):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(1500, 32, generator=g)
    index = AnnIndex(32, 128, "random", 0, 3, 2, "torch", code_precision=precision)
    index.build(w)
    want = C.encode(w, index.projection, precision=precision)[index.list_ids]
    assert torch.equal(index.list_codes, want)
    q = torch.randn(5, 32, generator=g)
    assert torch.equal(index.encode(q), C.encode(q, index.projection, precision=precision))
    index.refresh(w)  # the first refresh of every row starts tracking: float32 codes with margins
    assert index.encoded_from is not None
    assert torch.equal(index.list_codes, C.encode(w, index.projection)[index.list_ids])
