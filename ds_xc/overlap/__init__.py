"""Overlap pipeline: the head's communication and the backbone's gradient reduction under computation.

``schedule.py``  ChunkedHeadSchedule: micro-chunked head step with async gathers and reduce-scatters
``buckets.py``   BucketedGradReducer: backbone gradients reduced in buckets from gradient hooks
``timeline.py``  Timeline: per-step compute, communication issued and exposed
``comm.py``      the async padded collectives the schedule uses
"""
from ds_xc.overlap.buckets import BucketedGradReducer
from ds_xc.overlap.schedule import ChunkedHeadSchedule, side_group
from ds_xc.overlap.timeline import Timeline

__all__ = ["ChunkedHeadSchedule", "BucketedGradReducer", "Timeline", "side_group"]
