"""The user's scripts (``run.sh``, ``test.sh``, ``env.sh``, ``make_checkpoint.py``, ``demo.py``,
``sim_cluster.py``, ``gpu_check.sh``, the vLLM conformance lane's) and, in ``bench/``, the
benchmarks (``python -m scripts.bench.NAME``)."""
