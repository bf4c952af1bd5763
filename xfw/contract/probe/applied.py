"""The ``applied`` record of a run xfw attached to: what the probe saw, in the fields xfw's own
adapters fill, so the settings diff, the params column and the memory source read the same::

    {"kind": "applied", "framework": "torch", "compute_dtype": "bfloat16", "amp_level": "O1",
     "num_params_total": 190656, "num_params_trainable": 154048, "micro_batch": 4, "grad_accum_steps": 2,
     "step_boundary": "trainer callback", "notes": "attached to an unmodified command: ...", ...}

Where a field comes from, in order: what the objects show (the model's parameters and dtype, the
autocast state at its forward, its wrappers, the optimizer), then a Trainer's arguments (for what
objects do not show: recompute, the sharding stage, micro-batch and accumulation), then what the
DataLoader's batches showed, then the recipe. ``notes`` says which. Given the running probe
(:class:`~xfw.contract.probe.core.Probe`, which calls :func:`applied_record` when it finishes).
"""

from __future__ import annotations

BOUNDARIES = {"trainer": "trainer callback", "optimizer": "optimizer step"}


def _precision(probe, facts: dict) -> tuple[str, str, str, list[str]]:
    """(weight dtype, compute dtype, AMP level, notes): the autocast state seen at the model's forward."""
    weight, amp, notes = facts["weight_dtype"], probe.amp, []
    if amp is not None and amp.get("enabled"):
        compute, level = amp["dtype"], amp.get("level") or ("O1" if weight == "float32" else "O2")
    else:
        compute, level = weight, "O2" if weight != "float32" and facts["master_weights"] else "O0"
    if amp is None:
        notes.append("no forward seen before the first step: precision from the weights")
    elif amp.get("enabled"):
        notes.append(f"autocast {amp['dtype']} seen as the model's layers ran")
    asked = (probe.trainer or {}).get("compute_dtype")
    if asked and asked != compute:
        notes.append(f"the Trainer's arguments ask for {asked}, the forward ran {compute} (AMP {level})")
    return weight, compute, level, notes


SOURCES = {"forward": "the inputs that reached the model's forward", "loader": "the DataLoader's batches"}


def _batch(probe) -> tuple[int, int, str]:
    """(micro-batch, accumulation, where they come from)."""
    trainer, spec = probe.trainer or {}, probe.spec
    if trainer.get("micro_batch") and trainer.get("grad_accum_steps"):
        return trainer["micro_batch"], trainer["grad_accum_steps"], "the Trainer's arguments"
    if probe.last_step_batches:
        batches = probe.last_step_batches
        return max(s for s, _ in batches), len(batches), SOURCES[probe.count_source]
    return spec["batch"]["micro"], spec["derived"]["grad_accum_steps"], "the recipe"


def count_params(probe) -> tuple[int, int, dict[str, dict]]:
    """(total, trainable, breakdown) over every module that took part before the first step, each
    parameter once: the breakdown names each module with what it added (largest first), so a user
    sees what was counted. Without a module seen, the optimizer's parameters."""
    fw = probe.owner
    if not probe.modules:
        total, trainable = fw.count_params(None, probe.optimizer)
        return total, trainable, {"optimizer": {"total": total, "trainable": trainable}}
    sized = sorted(((fw.parameters(m), m) for m in probe.modules.values()), key=lambda pm: -sum(n for _, n, _ in pm[0]))
    seen, total, trainable, breakdown = set(), 0, 0, {}
    for params, module in sized:
        new = [(n, t) for i, n, t in params if i not in seen]
        seen.update(i for i, _, _ in params)
        if not new:
            continue
        added, added_trainable = sum(n for n, _ in new), sum(n for n, t in new if t)
        total, trainable = total + added, trainable + added_trainable
        name = type(module).__name__
        while name in breakdown:
            name += "'"
        breakdown[name] = {"total": added, "trainable": added_trainable}
    return total, trainable, breakdown


def applied_record(probe) -> dict:
    fw, trainer = probe.owner, probe.trainer or {}
    facts = fw.facts(probe.model, probe.wrapper, probe.optimizer)
    total, trainable, breakdown = count_params(probe)
    weight, compute, level, precision_notes = _precision(probe, facts)
    micro, accum, batch_source = _batch(probe)
    boundary = BOUNDARIES[probe.boundary_source]
    counted = {"forward": f"samples counted from the inputs that reached {type(probe.model).__name__}'s forward",
               "loader": "samples counted from its training DataLoader",
               "recipe": "samples from the recipe's batch (no forward or DataLoader showed a batch)"}
    notes = [f"attached to an unmodified command: steps end at its {boundary}", counted[probe.count_source],
             f"micro-batch and accumulation from {batch_source}",
             "parameters over " + ", ".join(f"{k} {v['total']} (trainable {v['trainable']})"
                                            for k, v in breakdown.items())]
    if trainer:
        notes.append("recompute and sharding from the Trainer's arguments")
    if probe.model is None:
        notes.append("parameters counted from the optimizer (no forward seen before the first step)")
    record = dict(
        framework=fw.name, framework_version=facts["framework_version"], device=facts["device"],
        device_name=facts["device_name"], weight_dtype=weight, compute_dtype=compute, amp_level=level,
        master_weights=bool(facts["master_weights"]),
        sharding_impl=trainer.get("sharding_impl") or facts["sharding_impl"],
        attention_impl=facts["attention_impl"], tf32=bool(facts["tf32"]),
        fused_optimizer=bool(facts["fused_optimizer"] or trainer.get("fused_optimizer")),
        recompute=bool(trainer["recompute"] if "recompute" in trainer else facts["recompute"]),
        num_params_total=total, num_params_trainable=trainable, num_processes=fw.world_size(),
        grad_accum_steps=accum, mem_source=fw.mem_source(), notes="; ".join(notes + precision_notes),
        micro_batch=micro, step_boundary=boundary, params_by_module=breakdown,
        **{f"version_{k}": v for k, v in facts["versions"].items()},
    )
    if "master_grad" in trainer:
        record["master_grad"] = bool(trainer["master_grad"])
    return record
