"""Parameter names: older Hugging Face checkpoint layouts, and LoRA adapters, onto the canonical names.

The canonical names (``xfw.contract.weights``) are the ones current transformers / diffusers / peft give
the model the PyTorch adapter builds. Two kinds of name reach a ``model.weights`` file that
are not canonical, and both adapters read them through this one table:

* **checkpoints saved by older transformers** (before the 4.52 refactor that moved the language
  model under ``model.``). transformers itself renames them on load with the class attribute
  ``_checkpoint_conversion_mapping``; the same regular expressions are here as plain data::

      >>> canonical_name("llava", "language_model.model.layers.0.mlp.up_proj.weight")
      'model.language_model.layers.0.mlp.up_proj.weight'
      >>> canonical_name("qwen2vl", "model.layers.0.mlp.up_proj.weight")
      'model.language_model.layers.0.mlp.up_proj.weight'

  A current name never matches a rule (every rule is anchored on the old prefix), so the map is
  applied to every name and is idempotent.

* **LoRA adapters**: peft's saved form (``get_peft_model_state_dict``) without its
  ``base_model.model.`` prefix: the adapted linear's canonical name, then ``lora_A.weight``
  ``[r, in]`` or ``lora_B.weight`` ``[out, r]``::

      model.language_model.layers.0.self_attn.q_proj.lora_A.weight
"""

from __future__ import annotations

import re

# family -> [(regex anchored at the start of a name, replacement)], applied in order, first match
# only. Sources: transformers 5.2 LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
# and Qwen2VLForConditionalGeneration ``_checkpoint_conversion_mapping``.
OLD_NAME_RULES: dict[str, list[tuple[str, str]]] = {
    "llava": [
        (r"^language_model\.model\.", "model.language_model."),
        (r"^language_model\.lm_head\.", "lm_head."),
        (r"^vision_tower\.", "model.vision_tower."),
        (r"^multi_modal_projector\.", "model.multi_modal_projector."),
        (r"^image_newline$", "model.image_newline"),
    ],
    "qwen2vl": [
        (r"^visual\.", "model.visual."),
        (r"^model\.(?!language_model\.|visual\.)", "model.language_model."),
    ],
    "sd15": [],  # diffusers' and transformers' CLIP text names are unchanged
    "sd3": [],
}

LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
_COMPILED = {family: [(re.compile(p), r) for p, r in rules] for family, rules in OLD_NAME_RULES.items()}


def canonical_name(family: str, name: str) -> str:
    """``name`` as the current layout spells it (unchanged when it already does, or when the
    family has no older layout)."""
    for pattern, replacement in _COMPILED.get(family, ()):
        new, count = pattern.subn(replacement, name, count=1)
        if count:
            return new
    return name


def canonical_names(family: str, names) -> dict[str, str]:
    """``{name in the file: canonical name}``; raises ValueError when two file names land on one."""
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        canon = canonical_name(family, name)
        if canon in seen:
            raise ValueError(f"tensors {seen[canon]!r} and {name!r} are both {canon!r} in the current layout")
        seen[canon] = name
        out[name] = canon
    return out


def is_lora(name: str) -> bool:
    """Whether a canonical name is a LoRA adapter's (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return name.endswith(LORA_SUFFIXES)


def peft_to_canonical(name: str) -> str:
    """A parameter name of a peft-injected torch model, canonical: the adapted linear's own weight
    is ``<linear>.base_layer.weight`` there, and adapters carry the adapter name (``default``)."""
    name = name.replace(".base_layer.", ".")
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.default.", f".{part}.")
    return name
