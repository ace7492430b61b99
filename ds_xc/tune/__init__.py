"""The configuration tuner behind launch/tune.py (docs/tuning.md): search space (space.py), one
candidate's measurement (measure.py), the ordered search and the choice (tuner.py), the cache
(cache.py), the outputs (report.py) and one run end to end (session.py)."""
from ds_xc.tune.report import default_output_path, plot, report_text, table, write_config
from ds_xc.tune.session import TuneResult, changed_keys, default_cache_dir, tune
from ds_xc.tune.space import TUNED_KEYS, Candidate, apply, build_space
from ds_xc.tune.tuner import Target, TargetUnreachable, choose, frontier

__all__ = ["tune", "TuneResult", "changed_keys", "default_cache_dir", "Target", "TargetUnreachable", "choose",
           "frontier", "TUNED_KEYS", "Candidate", "apply", "build_space", "table", "plot", "write_config",
           "report_text", "default_output_path"]
