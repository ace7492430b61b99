"""Cost models of a ds_xc job: communication (comm.py) and memory, predicted from the configuration."""
