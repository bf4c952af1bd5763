"""Real data prepared by the core (xfw.run.data) and read back (xfw.contract.batches), framework-free:
labels on answers only, one-line refusals naming file and sample, a cache keyed by content,
micro-batches in global-batch order whatever the process split, padding to the longest sample."""

import json
import os

import numpy as np
import pytest
import yaml

from xfw.contract import batches, families
from xfw.contract.records import validate_record
from xfw.report.measure import summarize
from xfw.run import data as real
from xfw.recipe import RecipeError, load_recipe, recipe_from_dict
from xfw.recipe.spec import resolve_spec

from conftest import TINY_RECIPE
from realdata import llava_json_recipe, make_captions, make_llava_data, make_tokenizer, picture


@pytest.fixture
def llava_data(tmp_path):
    return make_llava_data(tmp_path / "d")


def write(tmp_path, sections, name="r.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **sections}))
    return path


def spec_of(tmp_path, sections, **changes):
    return resolve_spec(load_recipe(write(tmp_path, {**sections, **changes})), backend="x", run_id="r")


def test_labels_train_only_the_answers_and_their_end_of_turn(tmp_path, llava_data):
    spec = spec_of(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache"))
    data = batches.PreparedData(spec["data"]["prepared"])
    vocab = {v: k for k, v in json.loads((llava_data["tokenizer"] / "tokenizer.json").read_text())["model"]["vocab"].items()}
    answers = []
    for i in range(len(data)):
        sample = data.sample(i)
        answers.append(" ".join(vocab[int(t)] for t in sample["labels"] if t >= 0))
        image_positions = sample["input_ids"] == spec["model"]["arch"]["image_token_id"]
        assert image_positions.sum() == (16 if i < 3 else 0)  # 56 px / 14 = 4 x 4 patches, CLS dropped
        assert (sample["labels"][image_positions] == -100).all() and sample["input_ids"][0] == 1  # BOS
    assert answers == ["A red disc . </s>", "Mostly blue . </s>", "Green squares on grey . </s>", "Hello there . </s>"]
    assert spec["data"]["stats"]["num_samples"] == 4 and spec["data"]["stats"]["samples_without_image"] == 1
    assert spec["data"]["longest"] == spec["data"]["stats"]["max_seq_len"]


@pytest.mark.parametrize("change, expected", [
    (lambda r: r[0].update(image="images/missing.png"), "sample #0 (id 's0'): image 'images/missing.png' not found under"),
    (lambda r: r[1].pop("image"), "sample #1 (id 's1'): 1 '<image>' in its conversation but 0 image(s)"),
    (lambda r: r[2]["conversations"][0].update(value="<image><image> two"), "sample #2 (id 's2'): 2 '<image>'"),
    (lambda r: r[3]["conversations"].pop(), "sample #3 (id 's3'): has no answer"),
    (lambda r: r.__setitem__(0, "not a sample"), "sample #0: must be an object with a 'conversations' list"),
])
def test_bad_samples_are_refused_in_one_line_naming_the_file_and_the_sample(tmp_path, llava_data, change, expected):
    records = json.loads(llava_data["json"].read_text())
    change(records)
    llava_data["json"].write_text(json.dumps(records))
    with pytest.raises(RecipeError) as err:
        load_recipe(write(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache")))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{tmp_path / 'r.yaml'}: data.path: {llava_data['json']}: ")
    assert expected in message


def test_too_long_samples_are_cut_or_refused_and_images_are_never_cut(tmp_path, llava_data):
    sections = llava_json_recipe(llava_data, tmp_path / "cache", seq_len=56)
    spec = spec_of(tmp_path, sections)
    assert spec["data"]["stats"]["max_seq_len"] == 56 and spec["data"]["stats"]["truncated"] > 0
    with pytest.raises(RecipeError, match=r"sample #0 \(id 's0'\): \d+ tokens, more than data.seq_len 56 "
                                          r"\(data.truncation is off\)"):
        spec_of(tmp_path, sections, data={**sections["data"], "truncation": False})
    # The vicuna template puts ~32 words before the image's 16 tokens: a cap of 40 would cut into them.
    with pytest.raises(RecipeError, match=r"sample #0 .*: its image tokens reach position \d+, past data.seq_len 40"):
        spec_of(tmp_path, sections, data={**sections["data"], "seq_len": 40})


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, llava_data):
    make_tokenizer(llava_data["tokenizer"], " ".join(f"w{i}" for i in range(600)))
    with pytest.raises(RecipeError, match=r"data.tokenizer: .*tokenizer.json holds 603 tokens, more than the "
                                          r"model's vocabulary of 512 \(model.arch.text.vocab_size\)"):
        load_recipe(write(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache")))


def test_text_that_tokenizes_to_the_image_id_is_refused(tmp_path, llava_data):
    sections = llava_json_recipe(llava_data, tmp_path / "cache")
    recipe = load_recipe(write(tmp_path, {**sections, "model": {"preset": "tiny-llava", "arch": {"image_token_id": 5}}}))
    with pytest.raises(real.DataError, match="its text tokenizes to the model's image token ids"):
        real.prepare_data(recipe, log=lambda line: None)  # found while tokenizing: the preparation step refuses it


def test_the_cache_is_reused_unchanged_and_rebuilt_when_data_tokenizer_or_settings_change(tmp_path, llava_data):
    sections = llava_json_recipe(llava_data, tmp_path / "cache")
    first = spec_of(tmp_path, sections)["data"]["prepared"]
    real._PREPARED.clear()  # as a new command would
    stamp = os.stat(f"{first}/index.json").st_mtime_ns
    assert spec_of(tmp_path, sections)["data"]["prepared"] == first
    assert os.stat(f"{first}/index.json").st_mtime_ns == stamp  # found, not rewritten
    seen = {first}
    picture(llava_data["images"] / "0.png", (40, 64), seed=99)  # an image's content
    real._PREPARED.clear()
    seen.add(spec_of(tmp_path, sections)["data"]["prepared"])
    make_tokenizer(llava_data["tokenizer"], "extra words " + (llava_data["json"].read_text()))
    seen.add(spec_of(tmp_path, sections)["data"]["prepared"])
    seen.add(spec_of(tmp_path, sections, data={**sections["data"], "seq_len": 100})["data"]["prepared"])
    assert len(seen) == 4
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(left) == 4 and not any(name.startswith(".tmp") for name in left)


def test_relative_paths_are_taken_from_the_recipe_and_from_the_current_directory_with_set(tmp_path, llava_data,
                                                                                       monkeypatch):
    recipe = write(tmp_path, {"data": {"kind": "llava_json", "path": "d/data.json", "tokenizer": "d/tok",
                                       "cache": "cache"}})
    monkeypatch.chdir(tmp_path / "d")
    loaded = load_recipe(recipe, ["data.tokenizer=tok"])
    assert loaded.data.path == str(llava_data["json"]) and loaded.data.tokenizer == str(llava_data["tokenizer"])
    assert loaded.data.cache == str(tmp_path / "cache")


def test_micro_batches_follow_the_global_batch_whatever_the_process_split(tmp_path, llava_data):
    sections = llava_json_recipe(llava_data, tmp_path / "cache")
    one = spec_of(tmp_path, sections, batch={"global": 4, "micro": 1}, measure={"warmup_steps": 1, "steps": 3})
    four = spec_of(tmp_path, sections, batch={"global": 4, "micro": 1}, measure={"warmup_steps": 1, "steps": 3},
                   parallel={"nproc_per_node": 4})

    def stream(spec, ranks):
        sets = [batches.MicroBatches(spec, r) for r in range(ranks)]
        accum = spec["derived"]["grad_accum_steps"]
        return [sets[r][step * accum + i][1][3:].tolist() for step in range(4) for r in range(ranks) for i in range(accum)]

    assert stream(one, 1) == stream(four, 4)
    # Each epoch visits every sample once, in its own seeded order.
    data = batches.MicroBatches(one, 0)
    epochs = [[data.sample_index(p) for p in range(e * 4, e * 4 + 4)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == [0, 1, 2, 3] and epochs[0] != epochs[1]


def test_a_micro_batch_is_padded_to_its_longest_sample_and_padding_is_neither_attended_nor_trained(tmp_path,
                                                                                               llava_data):
    spec = spec_of(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache"), batch={"global": 4, "micro": 4})
    batch, meta = batches.MicroBatches(spec, 0)[0]
    lengths = batch["attention_mask"].sum(axis=1)
    assert batch["input_ids"].shape[1] == lengths.max() and len(set(lengths.tolist())) > 1
    pad = batch["attention_mask"] == 0
    assert (batch["labels"][pad] == -100).all() and (batch["input_ids"][pad] == 0).all()
    tokens, padded, longest, digest = batches.unpack(meta)
    assert (tokens, padded, longest) == (lengths.sum(), batch["input_ids"].size, lengths.max())
    assert digest == batches.batch_hash(batch) and batch["pixel_values"].shape == (3, 3, 56, 56)  # 3 images


def test_captions_become_clip_ids_padded_to_max_length_and_images_scaled_to_plus_minus_one(tmp_path):
    paths = make_captions(tmp_path)
    sections = {"model": {"preset": "tiny-sd15"}, "stage": "pretrain",
                "data": {"kind": "image_captions", "path": str(paths["jsonl"]), "tokenizer": str(paths["tokenizer"]),
                         "cache": str(tmp_path / "cache")}}
    spec = spec_of(tmp_path, sections)
    batch, meta = batches.MicroBatches(spec, 0)[0]
    assert batch["input_ids"].shape == (2, 16) and (batch["input_ids"][:, 5:] == 1).all()  # 4 words + EOS... pad
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and -1 <= batch["pixel_values"].min() < batch["pixel_values"].max() <= 1
    assert batch["noise"].shape == (2, 4, 16, 16) and batches.unpack(meta)[:3] == (0, 0, 0)
    sd3 = spec_of(tmp_path, {**sections, "model": {"preset": "tiny-sd3"}, "stage": "dreambooth",
                             "data": {**sections["data"], "tokenizer": None}})
    reader = batches.MicroBatches(sd3, 0)
    again = next(p for p in range(4, 8) if reader.sample_index(p) == reader.sample_index(0))  # the next epoch's
    b1, b2 = reader.sample(0), reader.sample(again)
    np.testing.assert_array_equal(b1["prompt_embeds"], b2["prompt_embeds"])  # one caption, one embedding
    assert not np.array_equal(b1["noise"], b2["noise"])  # but each step its own noise


def test_schema_fields_are_checked_with_the_key_named():
    def error(**sections):
        with pytest.raises(RecipeError) as err:
            recipe_from_dict({**TINY_RECIPE, **sections}, "r.yaml")
        return str(err.value)

    assert error(optimizer={"max_grad_norm": -1}) == "r.yaml: optimizer.max_grad_norm: -1.0 is outside [0, 1e+06]"
    assert "data.path: is required for data kind 'llava_json'" in error(data={"kind": "llava_json", "tokenizer": "t"})
    assert "data.kind: image_captions data feeds sd15 and sd3 models, not llava" in error(
        data={"kind": "image_captions", "path": "m.jsonl"})
    assert "data.text_tokens: only applies to synthetic data" in error(
        data={"kind": "llava_json", "path": "a", "tokenizer": "t", "text_tokens": {"min": 1, "max": 2}})
    assert "data.text_tokens.max: 1 is below min 2" in error(data={"text_tokens": {"min": 2, "max": 1}})
    assert "data.template: must be one of" in error(data={"template": "llama3"})
    assert "model.trainable: names a part twice" in error(model={"preset": "tiny-llava", "trainable": ["text", "text"]})


def test_trainable_parts_and_text_lengths_are_checked_against_the_architecture(tmp_path):
    with pytest.raises(RecipeError, match=r"model.trainable: 'merger' is not a part of the llava model \(parts: "):
        load_recipe(write(tmp_path, {"model": {"preset": "tiny-llava", "trainable": ["merger"]}}))
    with pytest.raises(RecipeError, match="data.text_tokens.max: 60 text tokens after 17 others exceed data.seq_len 64"):
        load_recipe(write(tmp_path, {"data": {"text_tokens": {"min": 1, "max": 60}}}))
    spec = spec_of(tmp_path, {"model": {"preset": "tiny-qwen2-vl", "trainable": ["text"]}})
    assert families.spec_parts(spec) == ("text",)
    counts = families.analytic_counts(spec["model"]["arch"], "sft", trainable=["text"])
    assert counts["trainable_parts"] == {"text": counts["parts"]["text"]}


def test_synthetic_lengths_vary_within_their_distribution_and_pad_like_real_data(tmp_path):
    from xfw.contract import synthetic

    spec = spec_of(tmp_path, {"data": {"text_tokens": {"dist": "uniform", "min": 5, "max": 40}}},
                   batch={"global": 8, "micro": 4})
    pool = synthetic.make_pool(spec, 0)
    lengths = np.concatenate([b["attention_mask"].sum(axis=1) for b in pool])
    assert lengths.min() >= 17 + 5 and lengths.max() <= 17 + 40 and len(set(lengths.tolist())) > 4
    assert spec["data"]["longest"] == 57
    for b in pool:
        assert b["input_ids"].shape[1] == b["attention_mask"].sum(axis=1).max()
        assert (b["labels"][b["attention_mask"] == 0] == -100).all()
    again = synthetic.make_pool(spec, 0)
    assert [batches.batch_hash(b) for b in pool] == [batches.batch_hash(b) for b in again]


def test_step_records_carry_the_data_keys_and_the_summary_their_statistics():
    step = {"schema": 1, "kind": "step", "rank": 0, "step": 0, "phase": "measure", "step_time_s": 1.0, "samples": 4,
            "tokens": 75, "loss": 1.0, "mem_alloc_peak_bytes": None, "mem_reserved_peak_bytes": None,
            "padded_tokens": 100, "max_seq_len": 25, "batch_hashes": ["ab", "cd"]}
    assert validate_record(step) == []
    assert validate_record({**step, "batch_hashes": [1]}) == ["step: 'batch_hashes' must be a list of strings"]
    window = {"schema": 1, "kind": "window", "rank": 0, "window_time_s": 1.0, "num_steps": 1, "samples": 4,
              "tokens": 75, "padded_tokens": 100}
    m = summarize([step, window])
    assert m.padding_fraction == 0.25 and m.seq_len_mean == 75 / 4 and m.seq_len_max == 25
    assert m.num_batches == 2 and m.batch_digest and m.tokens_per_s == 75


class SlowLoaderSession:
    """A framework-free Session whose DataLoader takes ``delay`` seconds per micro-batch."""

    rank, num_ranks, delay = 0, 1, 0.05

    def __init__(self):
        self.fetched: list[str] = []

    def batches(self, dataset):
        import time

        for batch, meta in dataset:
            time.sleep(self.delay)
            self.fetched.append(batches.batch_hash(batch))
            yield batch, meta

    def to_device(self, batch):
        return batch

    def train_step(self, micro_batches):
        return float(sum(b["input_ids"].size for b in micro_batches))

    loss_token = loss_value = staticmethod(lambda x: x)

    def timestamp(self):
        import time

        return time.perf_counter()

    is_done = staticmethod(lambda stamp: True)
    elapsed_s = staticmethod(lambda start, end: end - start)
    synchronize = staticmethod(lambda: None)
    memory_peaks = staticmethod(lambda: (None, None))

    def applied(self):
        return {}


def test_prepared_data_is_read_inside_the_timed_window_and_every_micro_batch_hash_recorded(tmp_path, llava_data):
    from xfw.contract import harness
    from xfw.contract.records import read_records

    spec = spec_of(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache"),
                   measure={"warmup_steps": 1, "steps": 3})  # global 4 = micro 2 x accumulation 2
    spec["backend_knobs"] = {}
    session = SlowLoaderSession()

    class Writer(harness.rec.RecordWriter):
        def write(self, kind, **fields):
            if kind != "applied":  # the fake applies nothing
                super().write(kind, **fields)

    writer = Writer(tmp_path / "steps.jsonl", 0)
    harness.run_training(spec, writer, session)
    writer.close()
    records, problem = read_records(tmp_path / "steps.jsonl")
    assert problem == ""
    steps = [r for r in records if r["kind"] == "step"]
    assert [h for r in steps for h in r["batch_hashes"]] == session.fetched  # what the loader gave, in order
    assert len(session.fetched) == 4 * 2
    for r in steps[1:]:  # measured: each step's time holds its two fetches
        assert r["step_time_s"] >= 2 * SlowLoaderSession.delay and r["phase"] == "measure"
    window = next(r for r in records if r["kind"] == "window")
    assert window["tokens"] == sum(r["tokens"] for r in steps[1:]) < window["padded_tokens"]


def test_validate_prepares_real_data_and_says_what_it_holds(tmp_path, llava_data):
    from click.testing import CliRunner

    from xfw import cli

    recipe = write(tmp_path, llava_json_recipe(llava_data, tmp_path / "cache"))
    result = CliRunner().invoke(cli.main, ["validate", "--prepare", str(recipe)])
    assert result.exit_code == 0, result.output
    assert "  data: 4 samples, 3 images, sequence length mean 54.0 / max 59 (0 cut at data.seq_len), " \
           f"template vicuna_v1; prepared in {tmp_path / 'cache'}" in result.output
    records = json.loads(llava_data["json"].read_text())
    records[2]["image"] = "images/gone.png"
    llava_data["json"].write_text(json.dumps(records))
    result = CliRunner().invoke(cli.main, ["validate", str(recipe)])
    assert result.exit_code == 2 and "sample #2 (id 's2'): image 'images/gone.png' not found" in result.output


def test_loader_knobs_are_checked_by_the_adapters_with_the_key_named():
    from xfw.contract.harness import InvalidSpec, loader_settings

    spec = {"backend": "torch", "backend_knobs": {}}
    assert loader_settings(spec) == (0, 2)
    assert loader_settings({**spec, "backend_knobs": {"loader_workers": 4, "loader_prefetch": 1}}) == (4, 1)
    for knobs, key in (({"loader_workers": -1}, "loader_workers"), ({"loader_prefetch": 0}, "loader_prefetch"),
                       ({"loader_workers": True}, "loader_workers")):
        with pytest.raises(InvalidSpec, match=rf"backends.torch.{key}: must be an integer in"):
            loader_settings({**spec, "backend_knobs": knobs})
