"""Check a real-size CLI output against a float32 single-device reference computed expert by
expert from the decoded checkpoint weights (only the active experts are decoded, one at a time,
so the reference fits in ~2 GB even at Kimi-K3 size).

    python scripts/check_real_forward.py CKPT LAYER INPUT.safetensors OUTPUT.safetensors
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from moe_runtime import mxfp4  # noqa: E402
from moe_runtime.activation import GatedActivation  # noqa: E402
from moe_runtime.checkpoint import CheckpointReader  # noqa: E402
from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.router import route  # noqa: E402

ck, layer, inp, outp = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
cfg = LatentMoEConfig.from_pretrained(ck)
rd = CheckpointReader(ck)
p = rd.layer_prefix(layer)
x = load_file(inp)["hidden_states"].float()
act = GatedActivation.from_config(cfg)
gate, bias = rd.read(p + "gate.weight").float(), rd.read(p + "gate.e_score_correction_bias").float()
ids, wts = route(x, gate, bias, cfg)
h = x @ rd.read(p + "routed_expert_down_proj.weight").float().t()


def dec(name):
    return mxfp4.decode(rd.read(name + ".weight_packed"), rd.read(name + ".weight_scale"))


L = torch.zeros(x.shape[0], cfg.routed_expert_hidden_size)
for e in torch.unique(ids).tolist():
    w1, w3, w2 = (dec(f"{p}experts.{e}.{n}") for n in ("w1", "w3", "w2"))
    for t, k in (ids == e).nonzero().tolist():
        L[t] += wts[t, k].float() * (w2 @ act(w1 @ h[t], w3 @ h[t]))
gamma = rd.read(p + "routed_expert_norm.weight").float()
Ln = L * torch.rsqrt(L.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * gamma
R = Ln @ rd.read(p + "routed_expert_up_proj.weight").float().t()
shared = ("gate_proj", "up_proj", "down_proj")
sg, su, sd = (rd.read(p + f"shared_experts.{n}.weight").float() for n in shared)
ref = R + act(x @ sg.t(), x @ su.t()) @ sd.t()
got = load_file(outp)["output"].float()
err = (got - ref).abs()
print(json.dumps({"max_abs_err": err.max().item(), "ref_abs_max": ref.abs().max().item(),
                  "rel_fro": (err.norm() / ref.norm()).item()}))
