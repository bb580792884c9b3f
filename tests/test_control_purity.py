"""The control layer is pure: it imports and decides with Ray and torch.cuda unavailable.

A fresh interpreter blocks ``ray`` (and every ``ray.*`` module) in ``sys.modules`` and makes
any use of ``torch.cuda`` raise, imports every ``deployments.control`` and ``deployments.config``
module, and runs ``decide()`` on specs, a model config, a launcher config and a cluster view.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import importlib, pkgutil, sys
    import yaml

    class NoRay:  # `import ray` / `from ray... import` fail while this finder is first
        def find_spec(self, name, path=None, target=None):
            if name == "ray" or name.startswith("ray."):
                raise ImportError(f"{name} is blocked: the control layer must not import Ray")
            return None

    sys.meta_path.insert(0, NoRay())
    import torch

    def no_cuda(*args, **kwargs):
        raise RuntimeError("torch.cuda was touched")

    torch.cuda.is_available = no_cuda
    torch.cuda.device_count = no_cuda

    import deployments.config, deployments.control
    for package in (deployments.config, deployments.control):
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
    from deployments.control.decide import decide
    from deployments.control.cluster_view import ClusterView, NodeType
    from moe_runtime.synthetic import preset_config

    cluster = yaml.safe_load(open("cluster.yaml"))  # the launcher config, as a dict
    view = ClusterView("test", ({"CPU": 8.0},), (NodeType("mi300x", {"CPU": 96.0, "GPU": 8.0,
                       "accelerator_type:AMD-Instinct-MI300X-OAM": 1.0}, 4),))
    specs = [{"name": "a", "tp_size": 8, "layers": [1], "experts_format": "mxfp4", "dtype": "bfloat16",
              "autoscaling": {"min_replicas": 1, "max_replicas": 8}},
             {"name": "b", "tp_size": 8, "layers": [2], "experts_format": "mxfp4", "dtype": "bfloat16",
              "autoscaling": {"min_replicas": 1, "max_replicas": 8}}]
    decisions = decide(specs, preset_config("kimi-k3"), cluster=cluster, view=view)
    a = decisions["a"].to_dict()
    assert a["accelerator"] == "gpu" and a["compute"] == "gpu", a
    assert a["autoscaling_config"]["max_replicas"] == 2, a  # 4 nodes x 8 GPUs shared by two TP-8 ranges
    assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")]
    print("pure", sorted(decisions))
''')


def test_control_layer_decides_without_ray_or_cuda():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "pure ['a', 'b']" in run.stdout
