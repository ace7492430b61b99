"""Large-batch optimizers for the backbone: LAMB and LARS (layer-wise trust ratio), and how
they are built from the DeepSpeed JSON's ``optimizer`` section (docs/optimizers.md).

DeepSpeed's own ``"type": "Lamb"`` is a CUDA op (FusedLamb); ds_xc runs it where it builds and
runs, else :class:`Lamb` from here. ``"type": "LARS"`` (DeepSpeed has none) is :class:`Lars`.
"""
from ds_xc.optim.lamb import Lamb
from ds_xc.optim.lars import Lars

__all__ = ["Lamb", "Lars"]
