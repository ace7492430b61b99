"""Test hook (tests/test_comm_timeout.py): one rank of a 2-rank gloo job built with ``ds_xc.initialize``,
in which rank 1 never enters the collective that rank 0 then starts.

    python tests/timeout_driver.py MODE FOLDER     # with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT set

MODE: ``initialize`` (ds_xc.initialize starts torch.distributed; config xc_train.comm_timeout_s=5;
rank 0 waits on the world group), ``user_group`` (the script starts it with a 5 s timeout, the config
sets none; rank 0 waits on ds_xc's extra gloo group, the engine's flag_group) or ``user_group_config``
(the script's group keeps torch's default, the config sets 5 s; the flag_group again). Rank 0 prints
``TIMEOUTS world=<s> flag=<s>`` and ``FAILED after <s> s: <error>`` and exits 7; rank 1 stays alive,
outside any collective, until rank 0 has written FOLDER/done (at most 120 s), so that rank 0 can only
fail by its timeout, not by a closed connection.
"""
import datetime
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ds_xc  # noqa: E402
from ds_xc.parallel.groups import group_timeout  # noqa: E402

TIMEOUT_S = 5


def main(mode: str, folder: str) -> int:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 0},
           "extreme_classification": {"num_classes": 8, "embedding_dim": 4}}
    if mode in ("initialize", "user_group_config"):
        cfg["xc_train"] = {"comm_timeout_s": TIMEOUT_S}
    if mode == "user_group":
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    elif mode == "user_group_config":
        dist.init_process_group("gloo")  # torch's default timeout (30 minutes)
    body = torch.nn.Linear(3, 4)
    xc = ds_xc.initialize(model=body, optimizer=torch.optim.SGD(body.parameters(), lr=0.1), config=cfg)
    rank = dist.get_rank()
    done = os.path.join(folder, "done")
    if rank == 1:  # never enters the collective; alive until rank 0 is done
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
        return 0
    group = dist.group.WORLD if mode == "initialize" else xc.flag_group
    print(f"TIMEOUTS world={group_timeout(None)} flag={group_timeout(xc.flag_group)}", flush=True)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=group)
        print("NO ERROR", flush=True)
        code = 0
    except Exception as exc:  # gloo's timeout
        print(f"FAILED after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        code = 7
    open(done, "w").close()
    os._exit(code)  # no process-group teardown: the peer never answered


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
