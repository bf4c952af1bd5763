"""The cross-framework bf16 table of docs/testdevice.md from runs.json: per family, Paddle's bf16 O2 against
PyTorch's, against the bound 2 E + |pd32 - pt32| (E: PyTorch's bf16-vs-fp32 envelope), and the sharded runs'
largest relative distance from one process."""
import json
from pathlib import Path

runs = json.loads((Path(__file__).with_name("runs.json")).read_text())
for fam, r in runs["families"].items():
    pt16, pt32, pd32, pd16 = (r[k] for k in ("pt16", "pt32", "pd32", "pd16"))
    env = [max(abs(x[k] - y[k]) for x, y in zip(pt16, pt32)) for k in (0, 1)]
    own = [max(abs(x[k] - y[k]) for x, y in zip(pd16, pd32)) for k in (0, 1)]
    bounds = [[2 * env[k] + abs(p[k] - t[k]) for k in (0, 1)] for p, t in zip(pd32, pt32)]
    diffs = [[abs(p[k] - t[k]) for k in (0, 1)] for p, t in zip(pd16, pt16)]
    shard = [max(abs(x[k] - y[k]) / abs(y[k]) for st in ("pd16s2", "pd16s3") for x, y in zip(r[st], pd16)) for k in (0, 1)]
    print(f"{fam}: loss {max(d[0] for d in diffs):.1e} / {min(b[0] for b in bounds):.1e}, norm {max(d[1] for d in diffs):.1e} / "
          f"{min(b[1] for b in bounds):.1e}, own/PyTorch envelope {own[0] / env[0]:.2f}, {own[1] / env[1]:.2f}; "
          f"sharded vs one (relative) {shard[0]:.1e}, {shard[1]:.1e}")
