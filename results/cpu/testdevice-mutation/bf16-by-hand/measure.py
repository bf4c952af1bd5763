"""How runs.json was made (issue 35; docs/testdevice.md, "bf16 across frameworks"): per family, one torch export, then
the named runs through xfw's launcher. Usage: .venv/torch/bin/python THIS OUT_DIR FAMILY[,..] RUN[,..] (RUNS below);
XFW_TESTDEVICE_DIR=<a mutated build> for the mutated-device rows."""
import json, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from xfw.run import launcher
from xfw.run.parity import export_initial_weights
from xfw.run.recipe import load_recipe
from xfw.contract.records import load_records

ROOT = Path(__file__).resolve().parents[4]
PY = {"torch": ROOT / ".venv/torch/bin/python", "paddle": ROOT / ".venv/paddle/bin/python"}
SHORT = ["measure.warmup_steps=1", "measure.steps=2", "measure.timeout_s=400", "batch.global=4", "batch.micro=2"]
BF = ["precision.dtype=bf16", "precision.amp_level=O2"]
TESTCPU = ["backends.paddle.device=testcpu", "backends.paddle.grad_norm=true"]
TNORM = ["backends.torch.grad_norm=true"]
FAM = {"llava": ("recipes/tiny/llava_sft.yaml", []), "llava_next": ("recipes/tiny/llava_next_sft.yaml", []),
       "qwen2vl": ("recipes/tiny/qwen2vl_sft.yaml", []), "sd15": ("recipes/tiny/sd15_pretrain.yaml", ["measure.steps=1"]),
       "sd3": ("recipes/tiny/sd3_dreambooth.yaml", ["measure.steps=1"])}
out = Path(sys.argv[1]); fams = sys.argv[2].split(","); which = sys.argv[3].split(",")
def steps(r):
    recs = [x for x in load_records(f"{r.run_dir}/steps.jsonl") if x["kind"] == "step"]
    out=[]
    for st in sorted({x["step"] for x in recs}):
        th=[x for x in recs if x["step"]==st]
        out.append((sum(x["loss"] for x in th)/len(th), next(x.get("grad_norm_l2") for x in th if x["rank"]==0)))
    return out
RUNS = {"pt32": ("torch", TNORM), "pt16": ("torch", TNORM + BF), "pd32": ("paddle", TESTCPU), "pd16": ("paddle", TESTCPU + BF),
        "pt16m1": ("torch", TNORM + BF + ["batch.micro=1"]), "pd16m1": ("paddle", TESTCPU + BF + ["batch.micro=1"]),
        "pt32m1": ("torch", TNORM + ["batch.micro=1"]), "pd16s2": ("paddle", TESTCPU + BF + ["parallel.nproc_per_node=2", "parallel.sharding=stage2"]), "pd16s3": ("paddle", TESTCPU + BF + ["parallel.nproc_per_node=2", "parallel.sharding=stage3", "backends.paddle.sharding_segment_size=1024"]), "pd32m1": ("paddle", TESTCPU + ["batch.micro=1"])}
for fam in fams:
    recipe, extra = FAM[fam]
    start = out / fam / "start"
    if not (start / "model.safetensors").exists():
        export_initial_weights(str(ROOT / recipe), [*SHORT, *extra], launcher.Backend("torch", str(PY["torch"])), start, 300)
    res = {}
    for name in which:
        backend, ov = RUNS[name]
        b = launcher.Backend(backend, str(PY[backend]))
        rec = load_recipe(ROOT / recipe, [*SHORT, *extra, f"model.weights={start}", *ov])
        t = time.time()
        r = launcher.launch(rec, b, out / fam / name, description=launcher.describe_backend(b))
        res[name] = {"status": r.status, "reason": r.reason, "steps": steps(r) if r.status == "ok" else None, "s": round(time.time() - t, 1)}
        print(fam, name, json.dumps(res[name]), flush=True)
    p = out / fam / "res.json"
    old = json.loads(p.read_text()) if p.exists() else {}
    old.update(res); p.write_text(json.dumps(old, indent=1))
