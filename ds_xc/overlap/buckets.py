"""The bucketed gradient reducer: re-exported from :mod:`ds_xc.parallel.buckets`, where it
lives so that ds_xc/compression/overlapped.py can build on it without importing ds_xc.overlap."""
from ds_xc.parallel.buckets import BucketedGradReducer, plan_buckets

__all__ = ["BucketedGradReducer", "plan_buckets"]
