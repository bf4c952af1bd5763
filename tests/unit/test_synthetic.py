"""Synthetic data: seeded by (seed, rank, index) only, same bytes every time."""

import numpy as np

from xfw import synthetic
from xfw.recipe import recipe_from_dict, resolve_spec

from conftest import TINY_RECIPE


def spec(**changes):
    return resolve_spec(recipe_from_dict({**TINY_RECIPE, **changes}), backend="x", run_id="r")


def test_batches_are_identical_for_the_same_seed_rank_and_index():
    a, b = synthetic.make_batch(spec(), 0, 3), synthetic.make_batch(spec(), 0, 3)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_ranks_and_indices_get_different_data():
    s = spec()
    base = synthetic.make_batch(s, 0, 0)["input_ids"]
    assert not np.array_equal(base, synthetic.make_batch(s, 1, 0)["input_ids"])
    assert not np.array_equal(base, synthetic.make_batch(s, 0, 1)["input_ids"])


def test_llava_batch_places_one_image_token_per_patch_and_masks_them_from_the_loss():
    s = spec()
    arch = s["model"]["arch"]
    batch = synthetic.make_batch(s, 0, 0)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == (2, 64) and ids.dtype == np.int64
    assert batch["pixel_values"].shape == (2, 3, 56, 56) and batch["pixel_values"].dtype == np.float32
    assert ((ids == arch["image_token_id"]).sum(axis=1) == 16).all()  # (56 / 14) ** 2, CLS dropped
    assert (labels[ids == arch["image_token_id"]] == synthetic.IGNORE_INDEX).all()
    assert (labels[:, 0] == synthetic.IGNORE_INDEX).all()
    text = ids[:, 17:]
    assert (labels[:, 17:] == text).all() and text.min() >= 2 and text.max() < arch["text"]["vocab_size"]


def test_pool_has_the_configured_number_of_distinct_batches():
    pool = synthetic.make_pool(spec(data={"pool_size": 3}), rank=0)
    assert len(pool) == 3
    assert len({p["input_ids"].tobytes() for p in pool}) == 3
