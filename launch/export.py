"""Export the whole classifier head of a ds_xc checkpoint, rows in class order.

    python launch/export.py --load_dir ckpt --out head.safetensors          # one file (.pt without safetensors)
    python launch/export.py --load_dir ckpt --out head_dir --max_shard_rows 1000000   # row blocks + index

One file holds ``weight`` (C, d) and the format tag; with ``--max_shard_rows R`` the rows go
into ``OUT/head-IIIII-of-NNNNN.{safetensors,pt}`` blocks of at most R rows, listed (first
class, row count, sha256) in ``OUT/head.index.json``. The format follows ``--format``, else the
name of ``--out`` (``.safetensors`` / ``.pt``), else safetensors when it is installed and
``torch.save`` of plain tensors (which ``torch.load(weights_only=True)`` reads) otherwise;
safetensors asked for but not installed is an error before any work. The checkpoint's files
are checked against its sha256 manifest first (a damaged shard is refused, nothing written). Read it back, whole or one rank's rows, with
``ds_xc.checkpoint.load_exported_head(path)`` / ``load_exported_into_head(head, path)``.
One process, no process group and no collectives (started under a launcher with
WORLD_SIZE > 1 it refuses). The checkpoint is read shard by shard (memory-mapped): a sharded export needs about one
block of memory; a single file needs the whole head.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_xc.checkpoint import (EXPORT_FORMAT, EXPORT_INDEX, CheckpointError, ShardRows,  # noqa: E402
                              atomic_json, atomic_save, atomic_write, file_sha256,
                              refuse_under_launcher, resolve_tag)
from ds_xc.manifest import verify_manifest  # noqa: E402


def have_safetensors() -> bool:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        return False
    return True


def write_block(weight: torch.Tensor, path: str, class_start: int, num_classes: int) -> None:
    """One exported file: rows [class_start, class_start + len(weight)) of a num_classes head."""
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file
        atomic_write(path, lambda tmp: save_file({"weight": weight.contiguous()}, tmp, metadata={
            "format": EXPORT_FORMAT, "class_start": str(class_start), "num_classes": str(num_classes)}))
        return
    atomic_save({"format": EXPORT_FORMAT, "weight": weight.contiguous(), "class_start": class_start,
                 "num_classes": num_classes}, path)


def resolve_format(out: str, max_shard_rows: int, fmt: str) -> str:
    """The file format to write ("safetensors" or "pt"), checked before any work: ``--out X.safetensors``
    or ``--format safetensors`` without the package (or ``--out X.pt`` with ``--format safetensors``) is an
    error that says what to install or pass. ``auto`` follows the name of a single ``--out`` file, else
    takes safetensors when it is installed and pt otherwise."""
    named = None if max_shard_rows else next((f for f in ("safetensors", "pt") if out.endswith("." + f)), None)
    if fmt == "auto":
        fmt = named or ("safetensors" if have_safetensors() else "pt")
    if named is not None and named != fmt:
        raise CheckpointError(f"--out {out!r} names a .{named} file but --format is {fmt}; make them agree")
    if fmt == "safetensors" and not have_safetensors():
        raise CheckpointError(f"{'--out ' + repr(out) if named else '--format safetensors'}: the safetensors package "
                              "is not installed: pip install safetensors (or write torch's format: --format pt, "
                              "--out NAME.pt); nothing was read or written")
    return fmt


def export(tag_dir: str, out: str, max_shard_rows: int = 0, fmt: str = "auto") -> dict:
    """Write the head of checkpoint tag ``tag_dir`` to ``out``; returns what was written.

    The tag's files are checked against its checksum manifest first (as launch/reshard.py does): a
    truncated or bit-flipped shard is refused, naming the file, and nothing is written."""
    fmt = resolve_format(out, max_shard_rows, fmt)
    verify_manifest(tag_dir, "export")
    rows = ShardRows(tag_dir)
    c, d = rows.num_classes, rows.embedding_dim
    if not max_shard_rows:
        if os.path.isdir(out):
            raise CheckpointError(f"--out {out!r} is a folder; give a file name (or --max_shard_rows)")
        if not out.endswith((".safetensors", ".pt")):
            out = f"{out}.{fmt}"
        write_block(rows.rows(0, c), out, 0, c)
        return {"files": [out], "num_classes": c, "embedding_dim": d, "dtype": str(rows.dtype)}
    if max_shard_rows < 1:
        raise CheckpointError(f"--max_shard_rows {max_shard_rows}: must be >= 1 (or 0 for one file)")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise CheckpointError(f"--out {out!r} exists and is not an empty folder; give a new folder")
    os.makedirs(out, exist_ok=True)
    num_files = -(-c // max_shard_rows)
    entries = []
    for i in range(num_files):
        start = i * max_shard_rows
        count = min(max_shard_rows, c - start)
        name = f"head-{i:05d}-of-{num_files:05d}.{fmt}"
        path = os.path.join(out, name)
        write_block(rows.rows(start, count), path, start, c)
        entries.append({"file": name, "class_start": start, "num_rows": count, "sha256": file_sha256(path)})
    atomic_json({"format": EXPORT_FORMAT, "num_classes": c, "embedding_dim": d, "dtype": str(rows.dtype),
                  "source": os.path.abspath(tag_dir), "files": entries}, os.path.join(out, EXPORT_INDEX))
    return {"files": [os.path.join(out, e["file"]) for e in entries] + [os.path.join(out, EXPORT_INDEX)],
            "num_classes": c, "embedding_dim": d, "dtype": str(rows.dtype)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load_dir", required=True, help="the checkpoint folder (XCEngine.save_checkpoint's save_dir)")
    p.add_argument("--tag", help="the tag to export (default: the one in LOAD_DIR/latest)")
    p.add_argument("--out", required=True, help="output file, or a new folder with --max_shard_rows")
    p.add_argument("--max_shard_rows", type=int, default=0, help="rows per file of a sharded export (0: one file)")
    p.add_argument("--format", dest="fmt", choices=["auto", "safetensors", "pt"], default="auto",
                   help="file format (auto: safetensors when installed, else pt)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    refuse_under_launcher("export")  # no collectives here: one process does all the work
    try:
        resolve_format(args.out, args.max_shard_rows, args.fmt)  # a missing package: said before any work
        tag = resolve_tag(args.load_dir, args.tag)
        report = export(os.path.join(args.load_dir, tag), args.out, args.max_shard_rows, args.fmt)
    except (CheckpointError, FileNotFoundError, RuntimeError) as exc:
        raise SystemExit(f"export: {exc}") from None
    print(f"exported the head of {os.path.join(args.load_dir, tag)} ({report['num_classes']} classes x "
          f"{report['embedding_dim']}, {report['dtype']}) to {len(report['files'])} file(s):")
    for f in report["files"]:
        print(f"  {f}")
    return report


if __name__ == "__main__":
    main()
