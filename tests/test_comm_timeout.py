"""Process-group timeouts through the Python API (issue 59).

2 gloo ranks built with ds_xc.initialize, rank 1 never enters the collective that rank 0 starts
(tests/timeout_driver.py); rank 0 must fail with an error within about the configured 5 s, not
wait torch's 30 minutes:

* ``initialize`` starts torch.distributed itself: the world group takes ``xc_train.comm_timeout_s``
  (it took 1800 s whatever the config said);
* the caller started torch.distributed with a 5 s timeout and the config sets none: ds_xc's extra
  gloo group (the engine's flag_group) takes the caller's 5 s (it took torch's 30-minute default).

On the session's pool (a group the test harness started with 120 s): ds_xc's groups take the
config's ``xc_train.comm_timeout_s`` when it is set, with a warning that the caller's group keeps its
own, else the caller's 120 s.
"""
import logging
import os
import re

import pytest

from tests.train_procs import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "timeout_driver.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode,world_timeout", [("initialize", 5.0), ("user_group", 5.0)])
def test_a_rank_that_never_enters_a_collective_fails_the_other_within_the_timeout(tmp_path, mode, world_timeout):
    out = run_ranks([mode, str(tmp_path)], world=2, script=DRIVER, timeout=120, ok=False)
    assert f"TIMEOUTS world={world_timeout} flag=5.0" in out, out[-4000:]
    failed = re.search(r"FAILED after ([0-9.]+) s: (\w+): (.*)", out)
    assert failed, out[-4000:]
    waited = float(failed.group(1))
    assert 4.0 <= waited < 5 + 10, out[-4000:]  # the timeout, plus slack on a shared machine
    assert "timed out" in failed.group(3).lower() or "timeout" in failed.group(3).lower(), failed.group(0)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _timeouts_on_callers_group(rank, world, configured):
    import torch
    import ds_xc
    from ds_xc.parallel.groups import comm_timeout, group_timeout, set_comm_timeout
    before = comm_timeout()
    records = _Records()
    logging.getLogger("ds_xc.engine.setup").addHandler(records)
    try:
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "zero_optimization": {"stage": 0},
               "extreme_classification": {"num_classes": 8, "embedding_dim": 4}}
        if configured is not None:
            cfg["xc_train"] = {"comm_timeout_s": configured}
        body = torch.nn.Linear(3, 4)
        xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1), config=cfg)
        return group_timeout(None), group_timeout(xc.flag_group), records.messages
    finally:
        logging.getLogger("ds_xc.engine.setup").removeHandler(records)
        set_comm_timeout(before)  # the pool's later tests get the groups they had


def test_ds_xc_groups_take_the_configured_or_the_callers_timeout(pools):
    for rank, (world, flag, warnings) in enumerate(pools(2).run(_timeouts_on_callers_group, 7.0)):
        assert (world, flag) == (120.0, 7.0)
        expected = ("xc_train.comm_timeout_s=7 s applies to the process groups ds_xc creates; the world group you "
                    "started keeps its 120 s")
        assert any(expected in m for m in warnings) == (rank == 0), warnings
    for world, flag, warnings in pools(2).run(_timeouts_on_callers_group, None):
        assert (world, flag) == (120.0, 120.0)  # torch would have given ds_xc's group 30 minutes
        assert not any("comm_timeout_s" in m for m in warnings)
