"""The Paddle adapter's Stable Diffusion families, for real, and proof they are diffusers' models.

Tiny SD1.5 and SD3 train through ``.venv/paddle/bin/python`` (what the launcher runs). The
sameness checks build the PyTorch side's model here (the test interpreter is the torch
environment), export its weights to ``.npz``, load them into the Paddle model in a subprocess
(Linear weights transposed) and compare the prediction and the loss on one synthetic batch.
"""

import json
import math
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from xfw.contract import presets
from xfw.contract.families import sd3 as core_sd3
from xfw.contract.families import sd15 as core_sd15
from xfw.recipe import recipe_from_dict
from xfw.recipe.spec import resolve_spec
from xfw.contract.records import load_records, validate_record

from conftest import ROOT, applied, kinds, losses, require_interpreter, run_adapter

pytestmark = pytest.mark.contract
CORES = {"sd15": core_sd15, "sd3": core_sd3}
TRAINED = {"sd15": "unet", "sd3": "transformer"}


def recipe(name: str, **changes) -> dict:
    data = yaml.safe_load(Path(ROOT / "recipes" / "tiny" / f"{name}.yaml").read_text())
    return {**data, **changes}


def run_in_paddle(code: str, *args, timeout_s: float = 180) -> subprocess.CompletedProcess:
    python = require_interpreter("paddle")
    proc = subprocess.run([str(python), "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def torch_model(arch: dict, lora: dict | None = None):
    """The PyTorch side's model with every weight (LoRA B included) moved off its initial value,
    so that no zero-initialised layer can hide a mismatch."""
    torch = pytest.importorskip("torch")
    from xfw_torch.families import family_module
    from xfw_torch.session import apply_lora, lora_target

    family = family_module(arch["family"])
    torch.manual_seed(0)
    model = family.build(arch)
    if lora:
        apply_lora(lora_target(arch, model), lora)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return family, model


def torch_prediction(model, arch: dict, batch: dict):
    """xfw_torch's step up to the network's output (its loss_fn computes the same, then the MSE)."""
    torch = pytest.importorskip("torch")
    from xfw_torch.families.sd15 import encode_latents

    b = {k: torch.from_numpy(v) for k, v in batch.items()}
    with torch.no_grad():
        latents = encode_latents(model.vae, b["pixel_values"], arch["vae"])
        if arch["family"] == "sd15":
            text = model.text_encoder(b["input_ids"], return_dict=False)[0]
            sqrt_alpha, sqrt_one_minus_alpha = model.noise_coefficients(b["timesteps"])
            noisy = sqrt_alpha * latents + sqrt_one_minus_alpha * b["noise"]
            return model.unet(noisy, b["timesteps"], text, return_dict=False)[0].numpy()
        sigma = b["sigmas"].view(-1, 1, 1, 1)
        noisy = (1.0 - sigma) * latents + sigma * b["noise"]
        return model.transformer(hidden_states=noisy, encoder_hidden_states=b["prompt_embeds"],
                                 pooled_projections=b["pooled_prompt_embeds"],
                                 timestep=b["sigmas"] * model.num_train_timesteps, return_dict=False)[0].numpy()


def paddle_names(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """peft's parameter names and layouts -> paddlenlp.peft's (``lora_A`` is [in, r] in Paddle)."""
    name = name.replace(".base_layer.", ".")
    for part in ("lora_A", "lora_B"):
        if f".{part}.default.weight" in name:
            return name.replace(f".{part}.default.weight", f".{part}"), value.T
    return name, value


PADDLE_FORWARD = """
    import json, sys
    import numpy as np, paddle
    from paddlenlp.peft.lora.lora_layers import LoRALinear
    from xfw_paddle.families import family_module
    from xfw_paddle.families._sd_common import load_diffusers_state
    from xfw_paddle.model import lora_target

    results = {}
    for case in json.loads(open(sys.argv[1]).read()):  # every case in one process
        arch, lora = case["arch"], case["lora"]
        weights, batch = np.load(case["weights"]), np.load(case["batch"])
        family, out = family_module(arch["family"]), {}
        # SD1.5 also runs eager attention (SD3 has only SDPA); once is enough, without LoRA.
        for use_sdpa in ([True, False] if arch["family"] == "sd15" and not lora else [True]):
            model = family.build(arch, use_sdpa=use_sdpa, recompute=False)
            for p in model.parameters():
                p.stop_gradient = True
            if lora:
                family.apply_lora(lora_target(arch, model), lora)
            load_diffusers_state(model, weights)
            model.train()
            tensors = {k: paddle.to_tensor(v) for k, v in batch.items()}
            with paddle.no_grad():
                pred, _ = family.prediction(model, tensors)
                loss = family.loss_fn(model, tensors, paddle.no_grad)
            key = "sdpa" if use_sdpa else "eager"
            out[key] = {"pred": pred.numpy().tolist(), "loss": float(loss)}
        params = list(model.parameters())
        out["total"] = sum(int(p.size) for p in params)
        out["trainable"] = sum(int(p.size) for p in params if not p.stop_gradient)
        out["lora_layers"] = sorted(n for n, m in lora_target(arch, model).named_sublayers() if isinstance(m, LoRALinear))
        results[case["id"]] = out
    print(json.dumps(results))
"""


FORWARD_CASES = [("tiny-sd15", None), ("tiny-sd3", None), ("tiny-sd15", "sd15_lora"), ("tiny-sd3", "sd3_lora")]


@pytest.fixture(scope="module")
def forward(tmp_path_factory) -> dict:
    """{(preset, lora recipe): (the PyTorch model, its arch, its lora, the expected prediction and
    loss, what the Paddle model predicted with its weights)}: one Paddle process for every case."""
    torch = pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("forward")
    cases, built = [], {}
    for i, (preset, lora_name) in enumerate(FORWARD_CASES):
        arch = presets.resolve_arch(preset, {}, None, None)
        lora = recipe(lora_name)["lora"] if lora_name else None
        family, model = torch_model(arch, lora)
        model.train()
        batch = CORES[arch["family"]].make_batch(arch, 2, np.random.default_rng(0))
        expected_pred = torch_prediction(model, arch, batch)
        with torch.no_grad():
            expected_loss = float(family.loss_fn(model, {k: torch.from_numpy(v) for k, v in batch.items()}))
        weights, batch_file = directory / f"weights{i}.npz", directory / f"batch{i}.npz"
        np.savez(weights, **dict(paddle_names(n, p.detach().numpy()) for n, p in model.named_parameters()))
        np.savez(batch_file, **batch)
        cases.append({"id": str(i), "arch": arch, "lora": lora, "weights": str(weights), "batch": str(batch_file)})
        built[str(i)] = (model, arch, lora, expected_pred, expected_loss)
    (directory / "cases.json").write_text(json.dumps(cases))
    out = json.loads(run_in_paddle(PADDLE_FORWARD, directory / "cases.json",
                                   timeout_s=400).stdout.strip().splitlines()[-1])
    return {case: (*built[str(i)], out[str(i)]) for i, case in enumerate(FORWARD_CASES)}


@pytest.mark.parametrize("preset, lora_name", FORWARD_CASES)
def test_paddle_model_with_diffusers_weights_predicts_what_diffusers_predicts(forward, preset, lora_name):
    model, arch, lora, expected_pred, expected_loss, out = forward[(preset, lora_name)]
    for kernel in ("sdpa", "eager"):
        if kernel in out:
            pred = np.asarray(out[kernel]["pred"], dtype=np.float32)
            assert np.abs(pred - expected_pred).max() < 1e-4 * max(1.0, np.abs(expected_pred).max()), kernel
            assert out[kernel]["loss"] == pytest.approx(expected_loss, rel=1e-5), kernel
    assert out["total"] == sum(p.numel() for p in model.parameters())
    if lora:  # the same linears carry adapters on both sides, and only those train
        assert out["trainable"] == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        target = TRAINED[arch["family"]]
        wrapped = {n for n, m in getattr(model, target).named_modules()
                   if hasattr(m, "lora_A") and hasattr(m, "base_layer")}
        assert out["lora_layers"] == sorted(wrapped) and wrapped


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One short training run per tiny diffusion recipe: 2 warm-up + 4 measured steps."""
    out = {}
    for name in ("sd15_pretrain", "sd3_dreambooth"):
        code, records, stderr = run_adapter("paddle", tmp_path_factory.mktemp(name),
                                            **recipe(name, measure={"warmup_steps": 2, "steps": 4}))
        assert code == 0, stderr[-3000:]
        out[name] = records
    return out


def torch_trainable(name: str) -> int:
    torch = pytest.importorskip("torch")
    from xfw_torch.session import start_model

    spec = resolve_spec(recipe_from_dict(recipe(name)), backend="torch", run_id="t")
    with torch.device("meta"):
        model = start_model(spec, torch.device("meta"), "sdpa")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name, total", [("sd15_pretrain", 1_501_003), ("sd3_dreambooth", 759_811)])
def test_tiny_diffusion_recipe_trains_in_fp32_with_the_torch_sides_parameter_counts(runs, name, total):
    records = runs[name]
    for r in records:
        assert validate_record(r) == [], r
    assert kinds(records) == ["start"] + ["step"] * 6 + ["window", "applied", "end"]
    assert all(math.isfinite(x) for x in losses(records))
    assert sum(losses(records)[-2:]) < 0.97 * sum(losses(records)[:2]), losses(records)  # same pool pairs
    a = applied(records)
    assert (a["weight_dtype"], a["compute_dtype"], a["amp_level"]) == ("float32", "float32", "O0")
    assert a["recompute"] is False
    arch = presets.resolve_arch(recipe(name)["model"]["preset"], {}, None, None)
    assert a["num_params_total"] == presets.count_params(arch)["total"] == total
    assert a["num_params_trainable"] == torch_trainable(name) == presets.count_params(arch)[TRAINED[arch["family"]]]


def test_sd3_rejects_attention_it_cannot_run(tmp_path):
    code, records, stderr = run_adapter("paddle", tmp_path, **recipe("sd3_dreambooth", backends={
        "paddle": {"attn_implementation": "eager"}}, measure={"warmup_steps": 0, "steps": 1}))
    errors = [r for r in records if r["kind"] == "error"]
    assert code == 2 and errors[-1]["status"] == "invalid" and "attn_implementation" in errors[-1]["message"]


RECOMPUTE = """
    import json, sys
    import paddle
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw.contract.synthetic import make_pool
    from xfw_paddle.session import build_session

    out = {}
    for name, recipe in json.loads(sys.argv[1]).items():
        for recompute in (False, True):
            spec = resolve_spec(recipe_from_dict({**recipe, "recompute": recompute}), backend="paddle", run_id="t")
            session = build_session(spec)
            model = session.model
            unet = getattr(model, "unet", None)
            block = unet.down_blocks[0].resnets[0] if unet is not None else model.transformer.transformer_blocks[0]
            calls = []
            block.register_forward_pre_hook(lambda *args: calls.append(1))
            pool = [session.to_device(b) for b in make_pool(spec, 0)]
            step_losses = [float(session.train_step(pool[2 * s:2 * s + 2])) for s in range(2)]
            out[f"{name}/{recompute}"] = {"losses": step_losses, "calls": len(calls),
                                          "applied": session.applied()["recompute"]}
    print(json.dumps(out))
"""


def test_recompute_reruns_blocks_in_backward_and_changes_no_math():
    recipes = {name: recipe(name) for name in ("sd15_pretrain", "sd3_dreambooth")}
    out = json.loads(run_in_paddle(RECOMPUTE, json.dumps(recipes)).stdout.strip().splitlines()[-1])
    for name in recipes:
        plain, recomputed = out[f"{name}/False"], out[f"{name}/True"]
        assert (plain["applied"], recomputed["applied"]) == (False, True)
        assert recomputed["calls"] == 2 * plain["calls"] > 0, name  # each checkpointed block runs again
        assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-5), name


LORA_RUN = """
    import sys
    from xfw.contract import harness
    from xfw_paddle import session

    # The session takes the family's own apply_lora (xfw_paddle.model.add_lora): ppdiffusers' models.
    sys.exit(harness.main(session.build_session, session.describe, ["--spec", sys.argv[2], "--records", sys.argv[3]]))
"""


@pytest.mark.parametrize("name", ["sd15_lora", "sd3_lora"])
def test_lora_recipe_trains_only_the_adapters_through_the_session(tmp_path, name):
    spec = resolve_spec(recipe_from_dict(recipe(name, measure={"warmup_steps": 2, "steps": 4})),
                        backend="paddle", run_id="t")
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    run_in_paddle(LORA_RUN, spec["model"]["family"], tmp_path / "spec.json", tmp_path / "steps.jsonl")
    records = load_records(tmp_path / "steps.jsonl")
    for r in records:
        assert validate_record(r) == [], r
    assert all(math.isfinite(x) for x in losses(records))
    assert sum(losses(records)[-2:]) < sum(losses(records)[:2]), losses(records)
    a = applied(records)
    arch, lora = spec["model"]["arch"], spec["lora"]
    _, model = torch_model(arch, lora)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert a["num_params_trainable"] == adapters > 0
    assert a["num_params_total"] == presets.count_params(arch)["total"] + adapters
