"""End to end, as a user runs it: `xfw compare` across the real Paddle and PyTorch adapters.

Four commands, shared at module scope where one serves several tests: a parity run and a compare of tiny LLaVA
(the llava fixture), a compare whose Paddle side is rejected in another configuration (the rejected fixture:
also the parity lookup that must not match), and a compare of two real-data recipes."""

import json
import re
import subprocess

import pytest

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract


def xfw(*args, timeout=600):
    python = require_interpreter("torch")
    require_interpreter("paddle")
    return subprocess.run([str(python), "-m", "xfw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """One parity run of tiny LLaVA (2 steps), then one compare of it on both backends that looks that parity
    run up: the counts, the HTML page and the parity line are all read from this compare."""
    tmp = tmp_path_factory.mktemp("compare")
    parity = xfw("parity", "recipes/tiny/llava_sft.yaml", "--steps", "2", "--out", tmp / "parity")
    out = tmp / "out"
    result = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch", "--out", out,
                 "--parity", tmp / "parity", "--set", "measure.warmup_steps=1", "--set", "measure.steps=4")
    return tmp, parity, out, result


def test_compare_trains_both_backends_and_reports_equal_parameter_counts(llava):
    _, _, out, result = llava
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("| Tiny LLaVA"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # Each headline figure with its spread, or saying it has none (one run).
    assert cells[2].endswith(" (one run, no spread)") and cells[4].endswith(" (one run, no spread)")
    assert float(cells[2].split(" (")[0].replace(",", "")) > 0 and float(cells[4].split(" (")[0].replace(",", "")) > 0
    assert re.fullmatch(r"[+-][\d.]+% \(one run, no spread\)", cells[3]), cells[3]
    assert cells[-1] == "190,656 / 190,656 (trainable 154,048 / 154,048) ✓"
    # One memory measure on both sides (the training memory: peak RSS since the build minus the RSS after
    # it, both beside it), not Paddle's host allocator beside PyTorch's peak RSS, nor start-up posing as training.
    pattern = r"([\d.]+) MiB training \(peak RSS ([\d.]+) MiB, ([\d.]+) MiB after build; one run, no spread\)"
    assert all(re.fullmatch(pattern, cell) for cell in cells[5:7]), cells
    for cell in cells[5:7]:
        training, peak, after = map(float, re.fullmatch(pattern, cell).groups())
        assert training == pytest.approx(peak - after, abs=0.02) and training > 0
    assert "memory is measured from different sources" not in result.stdout
    for name in ("report.md", "report.csv", "chart.png"):
        assert (out / name).stat().st_size > 0
    digests = set()
    for backend in ("paddle", "torch"):
        summary = json.loads((out / "tiny-llava-sft" / backend / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["measurement"]["num_measured_steps"] == 4
        digests.add(summary["measurement"]["batch_digest"])
    assert len(digests) == 1 and None not in digests  # both sides trained on the same micro-batches


@pytest.fixture(scope="module")
def rejected(llava):
    """One compare of the recipe in another configuration (a different batch) whose Paddle side is given a weight
    file that is not one: the rejection the test below checks, and the parity lookup of a configuration the
    llava fixture's parity run does not vouch for (test_the_compare_report_shows_the_parity_run_of_the_same_recipe).
    One command where there were two: the PyTorch side trains once for both."""
    tmp = llava[0]
    out = tmp / "rejected"
    weights = tmp / "broken"
    weights.mkdir()
    (weights / "model.safetensors").write_text("not a safetensors file")  # only the adapter reads it
    result = xfw("compare", "recipes/tiny/llava_sft.yaml", "--backends", "paddle,torch", "--out", out,
                 "--parity", tmp / "parity", "--set", "batch.micro=2",
                 "--set", "measure.warmup_steps=0", "--set", "measure.steps=2",
                 "--set", f"backends.paddle.override.model.weights={weights}")
    return out, result


def test_a_backend_that_rejects_its_settings_loses_no_other_result(rejected):
    out, result = rejected
    assert result.returncode == 1
    row = next(line for line in result.stdout.splitlines() if line.startswith("| Tiny LLaVA"))
    assert "| **invalid** | n/a |" in row
    assert "paddle: invalid — model.weights:" in result.stdout and "not a safetensors file" in result.stdout
    torch_summary = json.loads((out / "tiny-llava-sft" / "torch" / "summary.json").read_text())
    assert torch_summary["status"] == "ok" and torch_summary["measurement"]["ips"] > 0


def test_the_compare_report_shows_the_parity_run_of_the_same_recipe(llava, rejected):
    tmp, parity, out, shown = llava  # the compare measured 1 + 4 steps: measure is not what parity vouches for
    assert parity.returncode == 0, parity.stderr[-2000:]
    assert shown.returncode == 0, shown.stderr[-2000:]
    line = next(line for line in shown.stdout.splitlines() if "Parity:" in line)
    assert "passed, 2 steps" in line and str(tmp / "parity") in line
    assert line in (out / "report.md").read_text()
    # Another configuration of the recipe (a different batch, and Paddle's own weights: the `rejected` compare) is
    # not vouched for by that run: the lookup is by the recipe's fingerprint. A different batch alone changes it:
    # tests/unit/test_parity_report.py::test_a_compare_finds_the_parity_run_of_the_same_recipe_by_fingerprint.
    _, other = rejected
    assert "Parity: no parity run" in other.stdout and "passed" not in next(
        line for line in other.stdout.splitlines() if "Parity:" in line)


def test_the_compare_html_is_the_whole_report_and_a_browser_renders_it(llava):
    import shutil

    _, _, out, result = llava
    assert result.returncode == 0, result.stderr
    page = (out / "report.html").read_text()
    assert "<script" not in page and "http://" not in page and "https://" not in page
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is not installed: `make test` installs Debian's chromium for this test")
    dom = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                          "--dump-dom", (out / "report.html").as_uri()], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for heading in ("Training benchmark", "Settings as applied", "Provenance"):
        assert f">{heading}</h" in dom
    assert dom.count("data:image/png;base64,") == 2  # the chart and the step breakdown, inside the page
    assert 'class="contrast"' in dom and 'class="provenance"' in dom and "random init (seed 0)" in dom
    import re

    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", dom)
    assert "NaN" not in text and ">None<" not in text  # numbers formatted, never a raw frame dump


def test_compare_on_real_data_trains_both_backends_on_identical_batches(tmp_path):
    """A tiny llava_json recipe (LLaVA-1.6 grids mixed in a micro-batch, padding) and a tiny
    image_captions one in one command: each side reads the prepared data through its own DataLoader
    inside the timed loop, and the report shows the two sides' micro-batch hashes equal."""
    out = tmp_path / "out"
    result = xfw("compare", "recipes/tiny/llava_next_json_sft.yaml", "recipes/tiny/sd15_captions.yaml",
                 "--backends", "paddle,torch", "--out", out, "--set", "measure.warmup_steps=1", "--set", "measure.steps=3",
                 # one loader worker process per side: the batches a worker reads are the same batches
                 "--set", "backends.torch.loader_workers=1", "--set", "backends.paddle.loader_workers=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("Batches: identical on both sides (8 micro-batch hashes equal") == 2
    assert "different batches" not in result.stdout
    assert result.stdout.count("✓ |") == 2  # both rows: equal parameter counts on both sides
    padding = next(line for line in result.stdout.splitlines() if line.startswith("| padding |"))
    paddle_cell, torch_cell = [c.strip() for c in padding.strip("|").split("|")][1:3]
    assert paddle_cell == torch_cell and paddle_cell.endswith("%")
    llava = json.loads((out / "tiny-llava-next-json-sft" / "torch" / "summary.json").read_text())["measurement"]
    assert 0 < llava["padding_fraction"] < 1 and llava["tokens_per_s"] > 0 and llava["seq_len_max"] <= 128
