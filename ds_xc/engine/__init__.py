"""DeepSpeed glue: a backbone engine plus a class-parallel head that the engine never touches.

Gradients flow through one graph: ``engine.backward(loss)`` runs backward through the head
and the backbone together. The engine divides the loss by the accumulation steps before
backward, so the head's gradient is scaled like the backbone's. Loss scaling (fp16) would
scale the head's gradient too, and is refused at start.

``core.py``           XCEngine: the step, phase markers, non-finite step skipping
``checkpointing.py``  staged, agreed save and load of engine + head shards + residuals + RNG
``rng.py``            the global RNG streams in a checkpoint
``setup.py``          initialize, init_distributed, config checks and the ranks' agreement on it
"""
from ds_xc.engine.core import PHASES, XCEngine
from ds_xc.engine.setup import (LaunchEnvError, check_launch_env, check_supported, cpu_friendly_deepspeed,
                                init_distributed, initialize, load_raw_config)
from ds_xc.peers import describe_comm_failure, gather_peers, is_comm_failure, lost_peers, stopped_peers

__all__ = ["initialize", "init_distributed", "XCEngine", "check_supported", "load_raw_config", "gather_peers",
           "lost_peers", "stopped_peers", "describe_comm_failure", "is_comm_failure", "PHASES",
           "cpu_friendly_deepspeed", "check_launch_env", "LaunchEnvError"]
