"""Synthetic data: seeded by each sample's place in the global batch, never by rank."""

import numpy as np

from xfw.contract import synthetic
from xfw.recipe import recipe_from_dict
from xfw.recipe.spec import resolve_spec

from conftest import TINY_RECIPE


def spec(**changes):
    return resolve_spec(recipe_from_dict({**TINY_RECIPE, **changes}), backend="x", run_id="r")


def test_a_sample_is_identical_every_time_it_is_made():
    a, b = synthetic.sample(spec(), 1, 3), synthetic.sample(spec(), 1, 3)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_slots_and_sample_indices_get_different_data():
    s = spec()
    base = synthetic.sample(s, 0, 0)["input_ids"]
    assert not np.array_equal(base, synthetic.sample(s, 1, 0)["input_ids"])
    assert not np.array_equal(base, synthetic.sample(s, 0, 1)["input_ids"])


def test_llava_batch_places_one_image_token_per_patch_and_masks_them_from_the_loss():
    s = spec()
    arch = s["model"]["arch"]
    batch = synthetic.make_pool(s, 0)[0]
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == (2, 64) and ids.dtype == np.int64
    assert batch["pixel_values"].shape == (2, 3, 56, 56) and batch["pixel_values"].dtype == np.float32
    assert ((ids == arch["image_token_id"]).sum(axis=1) == 16).all()  # (56 / 14) ** 2, CLS dropped
    assert (labels[ids == arch["image_token_id"]] == synthetic.IGNORE_INDEX).all()
    assert (labels[:, 0] == synthetic.IGNORE_INDEX).all()
    text = ids[:, 17:]
    assert (labels[:, 17:] == text).all() and text.min() >= 2 and text.max() < arch["text"]["vocab_size"]


def test_pool_holds_pool_size_steps_of_micro_batches():
    pool = synthetic.make_pool(spec(data={"pool_size": 3}), rank=0)
    assert len(pool) == 3 * 2  # 3 steps x 2 accumulation micro-batches (global 4 = micro 2 x 2)
    assert len({p["input_ids"].tobytes() for p in pool}) == 6


def test_every_step_sees_the_same_samples_whatever_the_process_split():
    def step_samples(s, num_ranks):
        pools = [synthetic.make_pool(s, rank) for rank in range(num_ranks)]
        accum = s["derived"]["grad_accum_steps"]
        return np.concatenate([pools[r][slot * accum + i]["input_ids"] for slot in range(2)
                               for r in range(num_ranks) for i in range(accum)])

    one = spec(batch={"global": 8, "micro": 2}, data={"pool_size": 2})
    four = spec(batch={"global": 8, "micro": 2}, data={"pool_size": 2}, parallel={"nproc_per_node": 4})
    assert one["derived"]["grad_accum_steps"] == 4 and four["derived"]["grad_accum_steps"] == 1
    np.testing.assert_array_equal(step_samples(one, 1), step_samples(four, 4))


def test_qwen2vl_samples_stack_position_ids_on_their_batch_axis():
    s = spec(model={"preset": "tiny-qwen2-vl"})
    batch = synthetic.make_pool(s, 0)[0]
    assert batch["position_ids"].shape == (3, 2, 64)
    assert batch["pixel_values"].shape == (2 * 64, 3 * 2 * 14 * 14)
    np.testing.assert_array_equal(batch["position_ids"][:, 0], batch["position_ids"][:, 1])
