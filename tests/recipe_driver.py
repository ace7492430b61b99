"""Run launch/train.py for several argument lists, each in a process forked from one that
imported torch, DeepSpeed, ds_xc and train.py already (one rank each).

``python tests/recipe_driver.py JOBS.json``: JOBS.json is a list of ``{"args": [...], "out": path}``;
each job's stdout and stderr go to its ``out`` file, then a line ``exit N``. The jobs run one after
the other; each child initialises its own process group (a fresh port) and runs train.py's
``main`` as ``python launch/train.py ARGS`` would, so a job cannot leak state into the next, but
the interpreter and its imports load once for all (tests/test_recipes.py: about 4 s saved per
recipe on 2 cores). The parent never touches torch.distributed or starts a thread before forking.
"""
import importlib.util
import json
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.dist_pool import free_port  # noqa: E402


def _train_module():
    spec = importlib.util.spec_from_file_location("ds_xc_launch_train", os.path.join(ROOT, "launch", "train.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _child(train, job: dict) -> None:
    """In the forked child: output to the job's file, a fresh rendezvous port, train.main, exit."""
    fd = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    code = 0
    try:
        train.main(job["args"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 (reported to the job's test through its file)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(path: str) -> int:
    with open(path) as fh:
        jobs = json.load(fh)
    train = _train_module()
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            _child(train, job)
        _, status = os.waitpid(pid, 0)
        with open(job["out"], "a") as fh:
            fh.write(f"\nexit {os.waitstatus_to_exitcode(status)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
