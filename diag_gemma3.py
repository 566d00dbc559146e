"""temporary: Gemma 3 on TE diagnostic (not committed)."""
import json, os, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, "tests")
from hf_models import make_hf_model

root = Path("/tmp/diag"); root.mkdir(exist_ok=True)
out = Path(os.environ["OUT"])
def variant(name, family, edit=None):
    d = root / name
    make_hf_model(family, d)
    if edit:
        c = json.loads((d / "config.json").read_text()); edit(c); (d / "config.json").write_text(json.dumps(c))
    return d
def samerope(c):
    c["rope_parameters"]["sliding_attention"]["rope_theta"] = c["rope_parameters"]["full_attention"]["rope_theta"]
def noscale(c):
    c["rope_parameters"]["full_attention"] = {"rope_type": "default", "rope_theta": c["rope_parameters"]["full_attention"]["rope_theta"]}
def bothsame(c):
    noscale(c); samerope(c)
cases = [
    ("g32_noscale", "gemma3", noscale, "32-true", {}, []),
    ("g32_bothsame", "gemma3", bothsame, "32-true", {}, []),  # name, family, edit, precision, env, extra args
    ("g32", "gemma3", None, "32-true", {}, []),
    ("g32_tf32", "gemma3", None, "32-true", {"NVIDIA_TF32_OVERRIDE": None}, []),
    ("g32_local", "gemma3", None, "32-true", {"LM_DIAG": "local"}, []),
    ("g32_norope", "gemma3", None, "32-true", {"LM_DIAG": "norope"}, []),
    ("g32_nowin", "gemma3", lambda c: c.update(sliding_window=4096), "32-true", {}, []),
    ("g32_samerope", "gemma3", samerope, "32-true", {}, []),
    ("g32_scale", "gemma3", lambda c: c.update(query_pre_attn_scalar=c["head_dim"]), "32-true", {}, []),
    ("g32_allfull", "gemma3", lambda c: c.update(layer_types=["full_attention"] * c["num_hidden_layers"]), "32-true", {}, []),
    ("mw32", "mistral_window", None, "32-true", {}, []),
    ("q3_32", "qwen3", None, "32-true", {}, []),
    ("gbf16_bfref", "gemma3", None, "bf16-mixed", {}, ["--reference_dtype", "bfloat16"]),
    ("gbf16_local", "gemma3", None, "bf16-mixed", {"LM_DIAG": "local"}, []),
]
procs = []
for i, (name, fam, edit, prec, env, extra) in enumerate(cases):
    d = variant(name, fam, edit)
    e = {**os.environ, "CUDA_VISIBLE_DEVICES": str(i % 2), "NVIDIA_TF32_OVERRIDE": "0", **{k: v for k, v in env.items() if v}}
    for k, v in env.items():
        if v is None: e.pop(k, None)
    cmd = [sys.executable, "-m", "lightning_mcore.cli", "verify", "--model", str(d), "--accelerator", "gpu",
           "--precision", prec, "--tolerance", "1", *extra]
    procs.append((name, subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
with open(out / "diag.jsonl", "w") as f:
    for name, p in procs:
        so, se = p.communicate(timeout=400)
        line = [l for l in so.splitlines() if l.startswith("{")]
        rec = json.loads(line[-1]) if line else {"error": se[-3000:]}
        rec["case"] = name
        f.write(json.dumps(rec) + "\n"); f.flush()
        print(name, rec.get("logit_diff"), rec.get("layer_diffs"), rec.get("layout"), rec.get("error", "")[-500:])
