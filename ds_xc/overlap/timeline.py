"""The overlap timeline: re-exported from :mod:`ds_xc.parallel.timeline`, where it lives so
that ds_xc.compression can record its waits without importing ds_xc.overlap."""
from ds_xc.parallel.timeline import Timeline, wait_work

__all__ = ["Timeline", "wait_work"]
