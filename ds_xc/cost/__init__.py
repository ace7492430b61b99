"""Cost models of the head and the reduction: memory (memory.py), communication (comm.py) and
compute time (compute.py), as functions of the config, the class count, the world size and the
batch; launch/tune.py prunes its search space with them (docs/tuning.md)."""
