"""Decisions, made once at build time: accelerator, capacity, tail, memory, Serve options and the
autoscaling policy. Pure: nothing here imports Ray (``tests/test_control_purity.py``)."""
