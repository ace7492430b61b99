"""Overlap pipeline: the head's communication and the backbone's gradient reduction under computation.

``schedule.py``  ChunkedHeadSchedule: micro-chunked head step with async gathers and reduce-scatters
``buckets.py``   re-exports BucketedGradReducer (ds_xc/parallel/buckets.py): buckets from gradient hooks
``timeline.py``  re-exports Timeline (ds_xc/parallel/timeline.py): compute, communication issued, exposed
``comm.py``      the async padded collectives the schedule uses
"""
from ds_xc.overlap.schedule import ChunkedHeadSchedule, side_group
from ds_xc.parallel.buckets import BucketedGradReducer
from ds_xc.parallel.timeline import Timeline

__all__ = ["ChunkedHeadSchedule", "BucketedGradReducer", "Timeline", "side_group"]
