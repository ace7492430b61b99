"""ClassParallelHead's constructor refuses what the config path refuses, with the config path's message
(the field, the value, what is allowed; issue 59)."""
import pytest
import torch

from ds_xc import ClassParallelHead
from ds_xc import config as cfg


@pytest.mark.parametrize("kwargs,text", [
    (dict(embedding_dim=0), "extreme_classification.embedding_dim: got 0; Input should be greater than or equal to 1"),
    (dict(init_std=float("nan")), "extreme_classification.init_std: got nan"),
    (dict(init_std=0.0), "extreme_classification.init_std: got 0.0; Input should be greater than 0"),
    (dict(dtype=torch.float16), "extreme_classification.dtype: got 'torch.float16'; input should be 'float32', "
                                "'float64' or 'bfloat16'"),
    (dict(num_classes=1), "extreme_classification.num_classes: got 1; Input should be greater than or equal to 2"),
    (dict(seed=-1), "extreme_classification.seed: got -1; Input should be greater than or equal to 0"),
])
def test_constructor_validates_like_the_config(kwargs, text):
    args = dict(embedding_dim=8, num_classes=10)
    args.update(kwargs)
    with pytest.raises(cfg.ConfigError, match="invalid ds_xc config") as info:
        ClassParallelHead(**args)
    assert text in str(info.value)
    section = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in args.items()}
    with pytest.raises(cfg.ConfigError) as by_config:  # the config path says the same
        ClassParallelHead.from_config(section)
    assert text.replace("'torch.float16'", "'float16'") in str(by_config.value)
