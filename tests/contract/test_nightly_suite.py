"""`xfw nightly` as a scheduler runs it: the CPU smoke suite on the real adapters, nights in a row,
an injected slowdown, a night killed mid-suite, and the report opened in a real headless browser.

The first night is README's `xfw nightly suites/cpu_smoke.yaml --history ...` as written (the shipped suite,
its three entries: tiny LLaVA and Qwen2-VL, vision-language models, and SD1.5 LoRA, a diffusion model), and
`--report-only` then rewrites its report: test_documented_commands counts both as run here (its COVERED) instead
of running that night again. The second night runs two of the entries, LLaVA and SD1.5 LoRA (Qwen2-VL is of
LLaVA's kind: every line of nightly and its report is run by the two), and the third (the injected slowdown)
LLaVA alone on both backends: one entry is all its verdict, exit code and two-backend report need; the first
two nights hold both entries' history. 12 runs in all, where running every entry every night would be 18."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import ROOT, require_interpreter

pytestmark = pytest.mark.contract

SUITE = ROOT / "suites" / "cpu_smoke.yaml"
KEPT = ("llava_sft.yaml", "sd15_lora.yaml")  # one entry of each kind (module docstring)
SLOWED = ("llava_sft.yaml",)  # the third night's one entry (module docstring)
ENTRIES = [e["recipe"].rsplit("/", 1)[-1] for e in yaml.safe_load(SUITE.read_text())["entries"]
           if e["recipe"].rsplit("/", 1)[-1] in KEPT]


def smoke_suite(directory: Path, kept: tuple[str, ...] = KEPT) -> Path:
    """The shipped smoke suite with only the ``kept`` entries, their recipes by absolute path."""
    suite = yaml.safe_load(SUITE.read_text())
    suite["entries"] = [{**e, "recipe": str((SUITE.parent / e["recipe"]).resolve())} for e in suite["entries"]
                        if e["recipe"].rsplit("/", 1)[-1] in kept]
    assert len(suite["entries"]) == len(kept)
    path = directory / "cpu_smoke.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def xfw(*args, timeout=900):
    python = require_interpreter("torch")
    require_interpreter("paddle")
    return subprocess.run([str(python), "-m", "xfw.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def verdicts(history: Path, night: str) -> dict[tuple[str, str, str], dict]:
    data = json.loads((history / "nights" / night / "nightly.json").read_text())
    return {(v["entry"], v["backend"], v["metric"]): v for v in data["verdicts"]}


@pytest.fixture(scope="module")
def nights(tmp_path_factory):
    """Three nights of the smoke suite in one history; the third, of LLaVA alone, with PyTorch's anomaly
    detection on."""
    history = tmp_path_factory.mktemp("nightly")
    suite = smoke_suite(tmp_path_factory.mktemp("suite"))
    slowed = smoke_suite(tmp_path_factory.mktemp("slowed"), SLOWED)
    done = {"n1": xfw("nightly", "suites/cpu_smoke.yaml", "--history", history)}  # README's, as written
    named = sorted(p.name for p in (history / "nights").glob("*"))  # by its date
    done["n1 name"] = first = named[0] if len(named) == 1 else f"one night, not {named}"
    report, rows = history / "nights" / first / "report.md", history / "history.jsonl"
    recorded = rows.read_bytes() if rows.exists() else None
    report.unlink(missing_ok=True)  # README's --report-only writes it again, from the history alone
    done["n1 report"] = xfw("nightly", "suites/cpu_smoke.yaml", "--history", history, "--report-only")
    done["n1 rewritten"] = report.exists() and rows.exists() and rows.read_bytes() == recorded  # trains nothing
    done.update({night: xfw("nightly", path, "--history", history, "--night", night, *extra)
                 for night, path, extra in (("n2", suite, ()),
                                            ("n3", slowed, ("--set", "backends.torch.detect_anomaly=true")))})
    return history, done


def test_the_smoke_suite_run_twice_builds_a_history_pandas_reads(nights):
    history, done = nights
    assert done["n1"].returncode == 0, done["n1"].stderr[-3000:]  # nothing to regress against yet
    # --report-only wrote the last night's report again, from the history alone, and trained nothing
    assert done["n1 report"].returncode == 0, done["n1 report"].stderr[-3000:]
    assert done["n1 rewritten"]
    frame = pd.read_json(history / "history.jsonl", lines=True)
    shipped = len(yaml.safe_load(SUITE.read_text())["entries"])
    n1 = done["n1 name"]
    assert frame[frame.night == n1].entry.nunique() == shipped == 3  # the suite as shipped: every entry
    first_two = frame[frame.night.isin([n1, "n2"])]
    assert len(first_two) == (shipped + len(ENTRIES)) * 2 and set(first_two.status) == {"ok"}
    assert (first_two.ips > 0).all() and first_two.mem_alloc_peak_bytes.notna().all()
    assert first_two.groupby(["entry", "backend"]).workload.nunique().eq(1).all()
    night2 = verdicts(history, "n2")
    ips = [v for key, v in night2.items() if key[2] == "ips"]
    assert len(ips) == len(ENTRIES) * 2 and all(v["baseline_nights"] == 1 for v in ips)
    # The exit code says exactly whether something was flagged (a scheduler alerts on it).
    assert done["n2"].returncode == (1 if any(v["flagged"] for v in night2.values()) else 0), done["n2"].stderr
    for night in (n1, "n2"):
        state = json.loads((history / "nights" / night / "night.json").read_text())
        assert state["finished_utc"] and state["backends"]["torch"]["framework_version"]


def test_an_injected_slowdown_is_flagged_and_the_exit_code_says_so(nights):
    history, done = nights
    night3 = verdicts(history, "n3")
    assert done["n3"].returncode == (1 if any(v["flagged"] for v in night3.values()) else 0), done["n3"].stderr[-3000:]
    assert {key[:2] for key in night3} == {(e, b) for e in frame_entries(history, "n3") for b in ("paddle", "torch")}
    flagged = 0
    for entry in frame_entries(history, "n3"):
        verdict = night3[(entry, "torch", "ips")]
        if verdict["verdict"] != "regression":
            # On a loaded machine two baseline nights can disagree so much that the tolerance (from their
            # spread) swallows the slowdown: then the verdict must say so, never contradict its own band.
            assert verdict["verdict"] == "ok" and abs(verdict["change"]) <= verdict["tolerance"], verdict
            continue
        flagged += 1
        assert verdict["change"] < -verdict["tolerance"] and verdict["baseline_nights"] == 2
        assert "detect_anomaly – → True" in verdict["note"]
        assert f"{entry} / torch: ips" in done["n3"].stdout
    if not flagged:  # every entry's band (from two disagreeing baseline nights) held the slowdown: said, not hidden
        pytest.xfail("the injected slowdown stayed inside every entry's noise band on this loaded machine: "
                     + "; ".join(f"{e}: {night3[(e, 'torch', 'ips')]['change']:+.0%} within "
                                 f"±{night3[(e, 'torch', 'ips')]['tolerance']:.0%}"
                                 for e in frame_entries(history, "n3")))
    page = (history / "report.html").read_text()
    assert page.index("regression(s) or failure(s)") < page.index("This night: paddle vs torch")


def frame_entries(history: Path, night: str) -> list[str]:
    frame = pd.read_json(history / "history.jsonl", lines=True)
    return sorted(frame[frame.night == night].entry.unique())


def test_the_report_is_one_self_contained_file_a_browser_renders(nights, tmp_path):
    history, _ = nights
    page = (history / "report.html").read_text()
    assert "http://" not in page and "https://" not in page and "<script" not in page
    # the bar chart and one trend per entry of the night shown (the third: SLOWED)
    assert page.count("data:image/png;base64,") == 1 + len(SLOWED) == 1 + len(frame_entries(history, "n3"))
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.fail("chromium is not installed: `make setup` installs Debian's chromium for this test")
    shot = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,2400", f"--screenshot={shot}", (history / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)
    import matplotlib.image

    pixels = (matplotlib.image.imread(shot)[..., :3] * 255).round().astype(int)

    def count(hex_color: str, tolerance: int = 6) -> int:
        rgb = [int(hex_color[i:i + 2], 16) for i in (1, 3, 5)]
        return int((abs(pixels - rgb).max(axis=-1) <= tolerance).sum())

    # The first box is red when the night flagged something, green otherwise: on a loaded machine two
    # baseline nights can disagree enough that the slowdown stays inside its band (the test above then
    # xfails and says so), and the page must then say "no regressions", not show a red box.
    flagged = any(v["flagged"] for v in verdicts(history, "n3").values())
    box = "#fde8e8" if flagged else "#e6f4ea"  # (an improvement's row is green too: no "not green" check)
    assert count(box) > 20_000 and (flagged or count("#fde8e8") < 2_000), flagged  # the regressions box
    assert count("#dde7f7") > 5_000  # the tables' header rows
    assert count("#2f6fdf") > 3_000 and count("#ee4c2c") > 3_000  # bars and trend lines of both backends
    top = pixels[: pixels.shape[0] // 4]
    rgb = [int(box[i:i + 2], 16) for i in (1, 3, 5)]
    assert (abs(top - rgb).max(axis=-1) <= 6).sum() > 20_000  # the box is at the top


def _kill_everything_under(marker: str) -> None:
    """SIGKILL every process whose command line mentions ``marker``: the CLI and its adapters, as a
    node failure or a scheduler's hard kill would."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_night_killed_mid_suite_resumes_without_losing_or_repeating_a_run(tmp_path):
    python = require_interpreter("torch")
    require_interpreter("paddle")
    suite = tmp_path / "one.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "kill-test", "backends": ["paddle", "torch"],
        "set": ["measure.warmup_steps=1", "measure.steps=30", "measure.cpu_threads=1"],
        "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]}))
    history = tmp_path / "history"
    cmd = [str(python), "-m", "xfw.cli", "nightly", str(suite), "--history", str(history)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    torch_steps = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(history.glob("nights/*/tiny-llava-sft/torch/steps.jsonl"))
        if found and '"kind": "step"' in found[0].read_text().replace('"kind":"step"', '"kind": "step"'):
            torch_steps = found[0]
            break
        time.sleep(0.1)
    assert torch_steps is not None, f"torch never started training: {proc.communicate()[1][-2000:]}"
    _kill_everything_under(str(history))
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    (night_dir,) = (history / "nights").iterdir()
    rows = [json.loads(line) for line in (history / "history.jsonl").read_text().splitlines()]
    assert [(r["backend"], r["status"]) for r in rows] == [("paddle", "ok")]  # the finished run is recorded
    assert not json.loads((night_dir / "night.json").read_text())["finished_utc"]
    assert not [p for p in history.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    paddle_summary = (night_dir / "tiny-llava-sft" / "paddle" / "summary.json").read_bytes()

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"night {night_dir.name} of suite kill-test: 2 runs (resuming" in again.stderr
    assert "tiny-llava-sft / paddle: ok, kept" in again.stderr
    assert (night_dir / "tiny-llava-sft" / "paddle" / "summary.json").read_bytes() == paddle_summary
    rows = [json.loads(line) for line in (history / "history.jsonl").read_text().splitlines()]
    assert sorted((r["night"], r["backend"], r["status"]) for r in rows) == [
        (night_dir.name, "paddle", "ok"), (night_dir.name, "torch", "ok")]
    torch_summary = json.loads((night_dir / "tiny-llava-sft" / "torch" / "summary.json").read_text())
    assert torch_summary["measurement"]["num_measured_steps"] == 30
    assert json.loads((night_dir / "night.json").read_text())["finished_utc"]
    assert sorted(p.name for p in (history / "nights").iterdir()) == [night_dir.name]  # resumed, not a new night


def test_a_bad_suite_launches_nothing(tmp_path):
    suite = tmp_path / "bad.yaml"
    suite.write_text(yaml.safe_dump({"name": "bad", "backends": ["paddle", "torch"],
                                     "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")],
                                     "set": ["batch.micro=3"]}))
    result = xfw("nightly", suite, "--history", tmp_path / "h")
    assert result.returncode == 2 and f"{suite}: entries[0]: " in result.stderr
    assert not (tmp_path / "h").exists()


def test_a_suite_may_start_its_night_with_a_selfcheck_of_the_machine(tmp_path):
    suite = tmp_path / "checked.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "checked", "backends": ["torch"],
        "set": ["measure.warmup_steps=1", "measure.steps=3", "measure.cpu_threads=1"],
        "selfcheck": {"families": ["llava"], "paths": ["attention-eager"]},
        "entries": [str(ROOT / "recipes/tiny/llava_sft.yaml")]}))
    history = tmp_path / "history"
    result = xfw("nightly", suite, "--history", history, "--night", "n1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "selfcheck: 2 verdicts, none failing" in result.stdout
    night = history / "nights" / "n1"
    checked = json.loads((night / "selfcheck" / "selfcheck.json").read_text())
    assert [(v["backend"], v["path"], v["verdict"]) for v in checked["verdicts"]] == [
        ("torch", "fp32", "pass"), ("torch", "attention-eager", "pass")]  # fp32 first: the reference
    report = (night / "report.md").read_text()
    assert "Selfcheck: every path checked here passes." in report and "## Selfcheck of this machine" in report
    assert "attention without the fused kernel (flash off)" in report
    assert "1 runs, each compared" in report  # the night's one entry: the selfcheck's runs are no result of it
    rows = [json.loads(line) for line in (history / "history.jsonl").read_text().splitlines()]
    assert [(r["entry"], r["status"]) for r in rows] == [("tiny-llava-sft", "ok")]  # the checks are no entry
