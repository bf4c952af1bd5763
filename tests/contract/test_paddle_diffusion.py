"""The Paddle adapter's Stable Diffusion families, for real, and proof they are diffusers' models.

Everything on the Paddle side runs in ONE ``.venv/paddle/bin/python`` process (the ``paddle_side``
fixture; a Paddle process is ~6-8 CPU s of imports): tiny SD1.5 and SD3 (and their LoRA recipes, and
SD3 asked for eager attention) train through the adapter's entry point, ``harness.main`` with
``xfw_paddle``'s session, what ``python -m xfw_paddle`` runs; the launcher's own path (an adapter
process) runs both families as shipped in test_parity.py (sd15_pretrain), test_compare_both_backends.py
(sd15_captions) and test_explain_both_backends.py::TestOtherFamilies (sd3_lora), and
test_every_tiny_recipe.py trains sd15_lora and sd3_dreambooth as shipped on both backends. The
sameness checks build the PyTorch side's model here (the test interpreter is the torch environment),
export its weights to ``.npz``, load them into the Paddle model in that process (Linear weights
transposed) and compare the prediction and the loss on one synthetic batch.
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

from conftest import ROOT, applied, kinds, losses, require_interpreter

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


PADDLE_SIDE = """
    import json, sys
    import numpy as np, paddle
    from paddlenlp.peft.lora.lora_layers import LoRALinear
    from xfw.contract import harness
    from xfw.contract.synthetic import make_pool
    from xfw.recipe import recipe_from_dict
    from xfw.recipe.spec import resolve_spec
    from xfw_paddle import session as paddle_session
    from xfw_paddle.families import family_module
    from xfw_paddle.families._sd_common import load_diffusers_state
    from xfw_paddle.model import lora_target

    jobs = json.loads(open(sys.argv[1]).read())
    results = {}
    for case in jobs["forward"]:  # the sameness cases
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

    # Recompute: each recipe's first block counted, with and without, over 2 steps of a session.
    recomputed = {}
    for name, recipe in jobs["recompute"].items():
        for recompute in (False, True):
            spec = resolve_spec(recipe_from_dict({**recipe, "recompute": recompute}), backend="paddle", run_id="t")
            session = paddle_session.build_session(spec)
            model = session.model
            unet = getattr(model, "unet", None)
            block = unet.down_blocks[0].resnets[0] if unet is not None else model.transformer.transformer_blocks[0]
            calls = []
            block.register_forward_pre_hook(lambda *args: calls.append(1))
            pool = [session.to_device(b) for b in make_pool(spec, 0)]
            step_losses = [float(session.train_step(pool[2 * s:2 * s + 2])) for s in range(2)]
            recomputed[f"{name}/{recompute}"] = {"losses": step_losses, "calls": len(calls),
                                                 "applied": session.applied()["recompute"]}

    # Runs through the adapter's entry point, one after another; their records go to the files named.
    # The session takes the family's own apply_lora (xfw_paddle.model.add_lora): ppdiffusers' models.
    codes = {name: harness.main(paddle_session.build_session, paddle_session.describe,
                                ["--spec", paths[0], "--records", paths[1]])
             for name, paths in jobs["runs"].items()}
    print(json.dumps({"forward": results, "recompute": recomputed, "codes": codes}))
"""


FORWARD_CASES = [("tiny-sd15", None), ("tiny-sd3", None), ("tiny-sd15", "sd15_lora"), ("tiny-sd3", "sd3_lora")]


RECOMPUTED = ("sd15_pretrain", "sd3_dreambooth")
RUNS = {  # what the paddle_side process trains through harness.main: name -> the recipe
    "sd15_pretrain": recipe("sd15_pretrain", measure={"warmup_steps": 2, "steps": 4}),
    "sd3_dreambooth": recipe("sd3_dreambooth", measure={"warmup_steps": 2, "steps": 4}),
    "sd15_lora": recipe("sd15_lora", measure={"warmup_steps": 2, "steps": 4}),
    "sd3_lora": recipe("sd3_lora", measure={"warmup_steps": 2, "steps": 4}),
    "sd3_eager": recipe("sd3_dreambooth", backends={"paddle": {"attn_implementation": "eager"}},
                        measure={"warmup_steps": 0, "steps": 1}),
}


@pytest.fixture(scope="module")
def paddle_side(tmp_path_factory) -> dict:
    """The one Paddle process (PADDLE_SIDE) and what it answered: "forward" {(preset, lora recipe): (the PyTorch
    model, its arch, its lora, the expected prediction and loss, what the Paddle model predicted with its
    weights)}, "recompute" {"name/recompute": losses, first-block calls, applied recompute} and "runs"
    {name: (exit code, records, spec)} for RUNS; "stderr", the process's last 3000 characters (a failed run's
    traceback)."""
    torch = pytest.importorskip("torch")
    directory = tmp_path_factory.mktemp("paddle_side")
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
    specs, runs = {}, {}
    for name, data in RUNS.items():
        specs[name] = resolve_spec(recipe_from_dict(data), backend="paddle", run_id="t")
        runs[name] = [str(directory / f"{name}.spec.json"), str(directory / f"{name}.steps.jsonl")]
        Path(runs[name][0]).write_text(json.dumps(specs[name]))
    jobs = {"forward": cases, "recompute": {name: recipe(name) for name in RECOMPUTED}, "runs": runs}
    (directory / "jobs.json").write_text(json.dumps(jobs))
    proc = run_in_paddle(PADDLE_SIDE, directory / "jobs.json", timeout_s=600)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"stderr": proc.stderr[-3000:],"forward": {case: (*built[str(i)], out["forward"][str(i)]) for i, case in enumerate(FORWARD_CASES)},
            "recompute": out["recompute"],
            "runs": {name: (out["codes"][name], load_records(Path(runs[name][1])), specs[name]) for name in RUNS}}


@pytest.mark.parametrize("preset, lora_name", FORWARD_CASES)
def test_paddle_model_with_diffusers_weights_predicts_what_diffusers_predicts(paddle_side, preset, lora_name):
    model, arch, lora, expected_pred, expected_loss, out = paddle_side["forward"][(preset, lora_name)]
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


def torch_trainable(name: str) -> int:
    torch = pytest.importorskip("torch")
    from xfw_torch.session import start_model

    spec = resolve_spec(recipe_from_dict(recipe(name)), backend="torch", run_id="t")
    with torch.device("meta"):
        model = start_model(spec, torch.device("meta"), "sdpa")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name, total", [("sd15_pretrain", 1_501_003), ("sd3_dreambooth", 759_811)])
def test_tiny_diffusion_recipe_trains_in_fp32_with_the_torch_sides_parameter_counts(paddle_side, name, total):
    """One short training run per tiny diffusion recipe: 2 warm-up + 4 measured steps."""
    code, records, _ = paddle_side["runs"][name]
    assert code == 0, paddle_side["stderr"]
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


def test_sd3_rejects_attention_it_cannot_run(paddle_side):
    code, records, _ = paddle_side["runs"]["sd3_eager"]
    errors = [r for r in records if r["kind"] == "error"]
    assert code == 2 and errors[-1]["status"] == "invalid" and "attn_implementation" in errors[-1]["message"]


def test_recompute_reruns_blocks_in_backward_and_changes_no_math(paddle_side):
    out = paddle_side["recompute"]
    for name in RECOMPUTED:
        plain, recomputed = out[f"{name}/False"], out[f"{name}/True"]
        assert (plain["applied"], recomputed["applied"]) == (False, True)
        assert recomputed["calls"] == 2 * plain["calls"] > 0, name  # each checkpointed block runs again
        assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-5), name


@pytest.mark.parametrize("name", ["sd15_lora", "sd3_lora"])
def test_lora_recipe_trains_only_the_adapters_through_the_session(paddle_side, name):
    code, records, spec = paddle_side["runs"][name]
    assert code == 0, paddle_side["stderr"]
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
