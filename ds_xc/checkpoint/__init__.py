"""Head shard checkpoints and exported heads: written atomically, read without code execution.

Every file is written whole or not at all (``files.py``: one atomic write) and read with
``torch.load(weights_only=True)`` (or safetensors): a damaged, truncated or tampered file
raises :class:`CheckpointError` naming the file, and never runs code. Shapes and class
ranges are checked against ``meta.json`` / the index.

``files.py``   atomic writes, fsync, publishing a staged tag, ``latest``, weights-only reads
``shards.py``  the per-rank head shards of a training checkpoint and their meta.json
``export.py``  exported heads (one matrix in class order) and loading them into a head
"""
from ds_xc.checkpoint.export import (EXPORT_FORMAT, EXPORT_INDEX, exported_head_shape, load_exported_head,
                                     load_exported_into_head, read_export_index)
from ds_xc.checkpoint.files import (CheckpointError, atomic_json, atomic_save, atomic_write, file_sha256,
                                    fsync_tree, load_file, publish_tag, refuse_under_launcher, resolve_tag,
                                    write_latest)
from ds_xc.checkpoint.shards import (HEAD_DIR, META_FILE, ShardRows, apply_head_state, check_head_checkpoint,
                                     check_shard, load_head_state, load_shard, read_head_state, read_meta,
                                     save_head_state, shard_file, write_meta)

__all__ = ["save_head_state", "load_head_state", "check_head_checkpoint", "shard_file", "atomic_save",
           "read_meta", "write_meta", "load_file", "load_shard", "ShardRows", "CheckpointError",
           "load_exported_head", "load_exported_into_head", "read_export_index", "file_sha256",
           "resolve_tag", "refuse_under_launcher", "read_head_state", "apply_head_state", "exported_head_shape",
           "EXPORT_FORMAT", "EXPORT_INDEX", "fsync_tree", "publish_tag", "write_latest", "atomic_write",
           "atomic_json", "check_shard", "HEAD_DIR", "META_FILE"]
