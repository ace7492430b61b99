"""How the example tests start an example: one process (``nproc`` 0) or ``nproc`` ranks under torchrun,
with a clean launcher environment (no inherited RANK, MASTER_ADDR, ...), one thread, and this checkout
first on the path."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def example_command(script: str, nproc: int) -> tuple[list, dict]:
    """(the command up to the script's arguments, its environment) for examples/<script>.py."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    launcher = [sys.executable] if nproc == 0 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc_per_node", str(nproc)]
    return launcher + [os.path.join(ROOT, "examples", f"{script}.py")], env
