"""data.group_by_modality (LLaVA's group_by_modality_length): micro-batches of one modality, each
group longest first, the order seeded per epoch; both backends read it through the same MicroBatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from xfw.contract.batches import MicroBatches, PreparedData, modality_order
from xfw.recipe import RecipeError, load_recipe
from xfw.recipe.spec import resolve_spec

ROOT = Path(__file__).resolve().parents[2]


def test_groups_hold_one_modality_sorted_longest_first_and_every_sample_once():
    lengths = np.array([5, 9, 1, 7, 3, 8, 2, 6, 4, 10])
    has_image = np.array([1, 1, 0, 1, 0, 1, 0, 1, 0, 1], dtype=bool)  # 6 with images, 4 without
    order = modality_order(lengths, has_image, group=2, seed=0, epoch=0)
    assert sorted(order.tolist()) == list(range(10))
    for k in range(0, 10, 2):
        pair = order[k:k + 2]
        assert len(set(has_image[pair])) == 1, pair  # 6 and 4 split evenly: no merged remainder
        assert lengths[pair[0]] >= lengths[pair[1]]
    assert not np.array_equal(order, modality_order(lengths, has_image, group=2, seed=0, epoch=1))
    assert np.array_equal(order, modality_order(lengths, has_image, group=2, seed=0, epoch=0))


def test_the_incomplete_groups_go_last_merged():
    lengths = np.arange(1, 8)
    has_image = np.array([1, 1, 1, 0, 0, 0, 0], dtype=bool)  # 3 + 4 in groups of 2: one image sample left
    order = modality_order(lengths, has_image, group=2, seed=3, epoch=0)
    assert order[-1] in np.flatnonzero(has_image)
    assert all(len(set(has_image[order[k:k + 2]])) == 1 for k in range(0, 6, 2))


def test_a_recipe_groups_real_data_by_modality_and_only_llava_json_may():
    recipe = load_recipe(ROOT / "recipes/tiny/llava_json_sft.yaml", ["data.group_by_modality=true"])
    spec = resolve_spec(recipe, backend="torch", run_id="x/torch")
    data = PreparedData(spec["data"]["prepared"])
    _, has_image = data.modalities()
    assert has_image.sum() == len(data) - 8  # the tiny set's 8 text-only questions
    batches = MicroBatches(spec, 0)
    epoch = [batches.sample_index(p) for p in range(len(data))]
    assert sorted(epoch) == list(range(len(data)))
    # 232 samples with images and 8 without fill groups of 2 (micro 2, one process) exactly: every
    # micro-batch of the epoch holds one modality (the ungrouped order mixes them in 8 micro-batches)
    assert all(has_image[epoch[k]] == has_image[epoch[k + 1]] for k in range(0, len(data), 2))
    with pytest.raises(RecipeError, match="data.group_by_modality: only applies to llava_json"):
        load_recipe(ROOT / "recipes/tiny/sd15_captions.yaml", ["data.group_by_modality=true"])
