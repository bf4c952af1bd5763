"""Hostile and unlucky input, round three (issue 25): the data cache, data files, tokenizer
configs and chat templates, attached commands that leave children, nightly paths and history,
CSV cells, assembly, signals and exit codes. Each case is refused in one line (exit 2) or
survived with nothing lost; the numbers in the names follow docs/reliability.md (15 to 21).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xfw import cli
from xfw.run import data as real
from xfw.run.data import images as img

from conftest import ROOT, TINY_RECIPE
from realdata import llava_json_recipe, make_captions, make_llava_data, make_tokenizer


def invoke(*args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def write_recipe(path: Path, sections: dict) -> Path:
    path.write_text(yaml.safe_dump({**TINY_RECIPE, **sections}))
    return path


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return make_llava_data(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def captions(tmp_path_factory):
    return make_captions(tmp_path_factory.mktemp("captions"))


def llava_validate(tmp_path, paths, **data):
    data.setdefault("image_root", str(paths["images"].parent))
    recipe = write_recipe(tmp_path / "r.yaml", llava_json_recipe(paths, tmp_path / "cache", **data))
    return invoke("validate", "--prepare", recipe)  # data refused by the preparation step, before any launch


def captions_validate(tmp_path, paths, **data):
    sections = {"model": {"preset": "tiny-sd15"}, "stage": "pretrain",
                "data": {"kind": "image_captions", "path": str(paths["jsonl"]), "tokenizer": str(paths["tokenizer"]),
                         "cache": str(tmp_path / "cache"), **data}}
    return invoke("validate", "--prepare", write_recipe(tmp_path / "sd.yaml", sections))


def conversations(tmp_path, llava, records) -> dict:
    """``llava``'s images and tokenizer with other conversations."""
    path = tmp_path / "conv.json"
    path.write_text(records if isinstance(records, str) else json.dumps(records))
    return {**llava, "json": path}


def sample(value="Which colour?", image="images/0.png", speaker="human", **extra):
    record = {"id": "x", "conversations": [{"from": speaker, "value": ("<image>\n" if image else "") + value},
                                           {"from": "gpt", "value": "Mostly blue."}], **extra}
    if image is not None:
        record["image"] = image
    return record


def bomb_png(path: Path, width: int = 100000, height: int = 100000) -> Path:
    """A PNG whose header claims ``width`` x ``height`` pixels, in under 100 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


# --- 20. data readers are total: data files that used to give a traceback ----------------------------

def test_20_a_decompression_bomb_is_refused_in_one_line_in_both_data_kinds(tmp_path, llava, captions):
    bomb_png(llava["images"] / "bomb.png")
    line = one_line_error(llava_validate(tmp_path, conversations(tmp_path, llava, [sample(image="images/bomb.png")])))
    assert "sample #0" in line and "100000x100000" in line
    pics = captions["jsonl"].parent
    bomb_png(pics / "bomb.png", 30000, 30000)  # a variation: under Pillow's own error, over its warning
    metadata = tmp_path / "metadata.jsonl"
    metadata.write_text(json.dumps({"file_name": "bomb.png", "text": "a picture of thing 1"}) + "\n")
    line = one_line_error(captions_validate(tmp_path, {**captions, "jsonl": metadata}, image_root=str(pics)))
    assert "line 1" in line and "30000x30000" in line


def test_20_an_image_that_is_not_an_image_is_refused_in_one_line(tmp_path, llava):
    (llava["images"] / "text.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)
    line = one_line_error(llava_validate(tmp_path, conversations(tmp_path, llava, [sample(image="images/text.png")])))
    assert "cannot preprocess" in line and "sample #0" in line


@pytest.mark.parametrize("records, expected", [
    ("[" * 200_000 + "]" * 200_000, "nested too deep"),
    ([sample(speaker=["human"])], "turn 0 is from ['human']"),
    ([sample(speaker={"a": 1})], "turn 0 is from {'a': 1}"),
    ('[{"id": "x", "conversations": [{"from": "human", "value": "\\ud800"}, {"from": "gpt", "value": "A."}]}]',
     "lone surrogate"),
    ([sample(speaker=7, id={"deep": ["x" * 10_000]})], "sample #0: turn 0"),
], ids=["nested", "from-list", "from-dict", "surrogate", "odd-id"])
def test_20_malformed_conversations_are_one_line(tmp_path, llava, records, expected):
    line = one_line_error(llava_validate(tmp_path, conversations(tmp_path, llava, records)))
    assert expected in line and len(line) < 400


def test_20_a_lone_surrogate_in_a_caption_is_one_line(tmp_path, captions):
    metadata = tmp_path / "metadata.jsonl"
    metadata.write_text('{"file_name": "0.png", "text": "a picture \\udc80 of"}\n')
    line = one_line_error(captions_validate(tmp_path, {**captions, "jsonl": metadata},
                                            image_root=str(captions["jsonl"].parent)))
    assert "line 1" in line and "surrogate" in line


def test_20_a_caption_holding_unicode_line_separators_is_one_caption(tmp_path, captions):
    metadata = tmp_path / "metadata.jsonl"
    lines = [{"file_name": "0.png", "text": "a picture\u2028of\u2029thing\x85 0\x0c"},
             {"file_name": "1.png", "text": "a picture of thing 1"}]
    metadata.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\r\n")
    result = captions_validate(tmp_path, {**captions, "jsonl": metadata}, image_root=str(captions["jsonl"].parent))
    assert result.exit_code == 0 and "data: 2 samples" in result.output, result.output


# --- tokenizer configs and chat templates -------------------------------------------------------------

def test_20_a_chat_template_doing_ordinary_arithmetic_and_formatting_still_renders(tmp_path, llava):
    source = ("{% for m in messages %}{{ m.role }} {{ '%s' % m.content }} {{ '{:>3}'.format(2 ** 3) }}"
              "{{ (2.5 ** 2) | round }} {{ 'ab' * 2 }} call 5551234567{{ eos_token }}{% endfor %}"
              "{% if add_generation_prompt %}assistant{% endif %}")
    paths = with_config(tmp_path, llava, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": source})
    result = llava_validate(tmp_path, paths)
    assert result.exit_code == 0 and "template tokenizer" in result.output, result.output


def with_config(tmp_path, llava, config: dict, name="tok") -> dict:
    words = json.loads((llava["tokenizer"] / "tokenizer.json").read_text())["model"]["vocab"]
    tokenizer = make_tokenizer(tmp_path / name, " ".join(w for w in words if not w.startswith("<")), config=config)
    return {**llava, "tokenizer": tokenizer}


LOOP = "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
TEMPLATES = {
    "syntax": ("{% for m in messages %}{{ m.content }", "does not compile (line 1)"),
    "unknown-filter": ("{{ messages | nosuchfilter }}", "No filter named 'nosuchfilter'"),
    "unknown-filter-late": ("{% if messages %}{{ messages | nosuchfilter }}{% endif %}", "nosuchfilter"),
    "escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "the chat template fails"),
    "escape-format": ("{{ '{0.__class__.__init__.__globals__}'.format(messages) }}", "the chat template fails"),
    "type-error": ("{{ messages + 1 }}", "the chat template fails"),
    "loop": (LOOP, "did not finish within"),
    "repeat": ("{{ 'x' * 10**12 }}", "the chat template fails"),
    "grow": ("{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}", "more than"),
    "recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "the chat template"),
    "raise": ("{{ raise_exception('no system role') }}", "the chat template says: no system role"),
    "percent-width": ("{{ '%999999999s' % 'x' }}", "format width"),
    "format-width": ("{{ '{:999999999}'.format(1) }}", "format width"),
    "center": ("{{ 'x' | center(10000000000) }}", "beyond what a chat template may ask for"),
    "indent": ("{{ 'x\ny' | indent(10000000000) }}", "beyond what a chat template may ask for"),
    "format-filter": ("{{ '%999999999s' | format('x') }}", "format width"),
    "lipsum": ("{{ lipsum(1000000000) }}", "the chat template fails"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_20_a_chat_template_that_fails_loops_or_escapes_is_one_line_and_leaves_no_temporary(tmp_path, llava, name,
                                                                                             monkeypatch):
    from xfw.run.data import template

    monkeypatch.setattr(template, "TIME_S", 1.0)
    source, expected = TEMPLATES[name]
    paths = with_config(tmp_path, llava, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": source})
    started = time.monotonic()
    line = one_line_error(llava_validate(tmp_path, paths))
    assert expected in line and len(line) < 400, line
    assert time.monotonic() - started < 30
    assert not [p for p in (tmp_path / "cache").glob(".tmp-*")] if (tmp_path / "cache").exists() else True


def test_20_a_special_token_or_template_writing_image_marks_is_one_line(tmp_path, llava):
    paths = with_config(tmp_path, llava, {"bos_token": "<s>", "eos_token": "<image>"})
    assert "writes '<image>' itself" in one_line_error(llava_validate(tmp_path, paths))
    paths = with_config(tmp_path, llava, {"eos_token": "</s>", "chat_template": "{% for m in messages %}<image>"
                                          "{{ m.content }}{% endfor %}"}, name="tok2")
    assert "writes '<image>' itself" in one_line_error(llava_validate(tmp_path, paths))


@pytest.mark.parametrize("config, key", [({"eos_token": 5}, "eos_token"), ({"bos_token": ["<s>"]}, "bos_token"),
                                         ({"pad_token": {"content": 3}}, "pad_token"),
                                         ({"chat_template": 7}, "chat_template")])
def test_20_a_tokenizer_config_of_the_wrong_types_is_one_line_naming_the_key(tmp_path, llava, config, key):
    line = one_line_error(llava_validate(tmp_path, with_config(tmp_path, llava, config)))
    assert "tokenizer_config.json" in line and key in line


# --- 20. image paths ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [("../outside.png", "'..'"), ("images/../../outside.png", "'..'"),
                                            ("/etc/passwd", "absolute path")])
def test_20_an_image_path_leaving_the_image_root_is_refused(tmp_path, llava, name, expected):
    line = one_line_error(llava_validate(tmp_path, conversations(tmp_path, llava, [sample(image=name)]),
                                         image_root=str(llava["images"].parent)))
    assert expected in line and "sample #0" in line


def test_20_a_symlink_out_of_the_image_root_is_followed_and_counted(tmp_path, llava, captions):
    root = tmp_path / "root"
    root.mkdir()
    (root / "linked.png").symlink_to(llava["images"] / "0.png")
    paths = conversations(tmp_path, llava, [sample(image="linked.png")])
    assert spec_of(tmp_path, paths, image_root=str(root))["data"]["stats"]["images_outside_root"] == 1
    metadata = root / "metadata.jsonl"
    metadata.write_text(json.dumps({"file_name": "../x.png", "text": "a picture"}) + "\n")
    line = one_line_error(captions_validate(tmp_path, {**captions, "jsonl": metadata}))
    assert "'..'" in line and "line 1" in line


def spec_of(tmp_path, paths, **data) -> dict:
    from xfw.recipe import load_recipe
    from xfw.recipe.spec import resolve_spec

    recipe = load_recipe(str(write_recipe(tmp_path / "rr.yaml", llava_json_recipe(paths, tmp_path / "cache", **data))))
    return resolve_spec(recipe, backend="x", run_id="r")


# --- 15. the data cache is verified before a run trusts it ----------------------------------------------

def prepared_spec(tmp_path, llava) -> dict:
    return spec_of(tmp_path, llava, image_root=str(llava["images"].parent))


@pytest.mark.parametrize("damage", ["nan", "truncate", "delete", "index-without-digests", "index-edited",
                                    "index-deleted"])
def test_15_a_tampered_or_half_deleted_cache_entry_is_prepared_again_never_trained_on(tmp_path, llava, capfd, damage):
    from xfw.contract import batches

    real._PREPARED.clear()
    clean = prepared_spec(tmp_path, llava)["data"]
    directory = Path(clean["prepared"])
    pixels = directory / "pixel_values.npy"
    if damage == "nan":  # the case: same size, same header, NaN everywhere
        values = np.load(pixels)
        np.save(pixels, np.full_like(values, np.nan))
    elif damage == "truncate":
        pixels.write_bytes(pixels.read_bytes()[:-4])
    elif damage == "delete":
        (directory / "labels.npy").unlink()
        (directory / "labels.offsets.npy").unlink()
    elif damage == "index-deleted":
        (directory / "index.json").unlink()
    else:
        index = json.loads((directory / "index.json").read_text())
        if damage == "index-edited":
            index["num_samples"] = 2
        else:
            del index["files"]
        (directory / "index.json").write_text(json.dumps(index))
    real._PREPARED.clear()  # a new command
    again = prepared_spec(tmp_path, llava)["data"]
    assert "preparing it again" in capfd.readouterr().err
    assert again["fingerprint"] == clean["fingerprint"] and again["prepared"] == clean["prepared"]
    data = batches.PreparedData(again["prepared"])
    assert np.isfinite(np.load(pixels)).all() and len(data) == 4 and data.sample(3)["labels"].size
    assert real.cache.verify(directory, real.cache.read_stats(directory)) is None
    assert not list(directory.parent.glob(".tmp-*"))


def test_15_an_abandoned_temporary_directory_is_removed_and_a_live_one_kept(tmp_path, llava):
    import fcntl

    cache = tmp_path / "cache"
    killed = cache / ".tmp-llava_json-abc-killed"
    (killed / "sub").mkdir(parents=True)
    (killed / "input_ids.raw").write_bytes(b"x" * 100)
    live = cache / ".tmp-llava_json-def-live"
    live.mkdir()
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a preparation beside this one, still writing
    try:
        real._PREPARED.clear()
        prepared_spec(tmp_path, llava)
        assert not killed.exists() and live.exists()
    finally:
        os.close(fd)


def test_15_a_preparation_that_fails_while_finishing_leaves_no_temporary_directory(tmp_path, llava, monkeypatch):
    import errno

    def full(path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(real.cache, "_sha256", full)
    real._PREPARED.clear()
    line = one_line_error(llava_validate(tmp_path, llava))
    assert "No space left on device" in line
    assert not list((tmp_path / "cache").glob(".tmp-*")) and not list((tmp_path / "cache").glob("llava_json-*"))


# --- 16. no process outlives xfw ---------------------------------------------------------------------

DAEMON = """
import os, sys, time
pid = os.fork()
if pid == 0:
    os.setsid()                      # its own session and process group
    if {double} and os.fork() > 0:   # double fork: the daemon's parent exits at once
        os._exit(0)
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    os._exit(0)
if {double}:
    os.waitpid(pid, 0)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
time.sleep({linger})
"""


def daemon_recipe(tmp_path, *, double: bool, linger: float) -> tuple[Path, Path]:
    script = tmp_path / "daemon.py"
    script.write_text(DAEMON.format(double=double, linger=linger))
    pid_file = tmp_path / "daemon.pid"
    recipe = write_recipe(tmp_path / "attach.yaml", {
        "measure": {"warmup_steps": 1, "steps": 2, "timeout_s": 120},
        "backends": {"mine": {"command": [sys.executable, str(script), str(pid_file)], "cwd": str(tmp_path)}}})
    return recipe, pid_file


STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)     # the command ignores the launcher's SIGTERM ...
if os.fork() == 0:
    os.setsid()                                   # ... and so does its daemon, in its own session
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
    os._exit(0)
time.sleep(600)
"""


def test_16_a_timed_out_command_ignoring_sigterm_takes_its_daemon_with_it(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    pid_file = tmp_path / "daemon.pid"
    recipe = write_recipe(tmp_path / "attach.yaml", {
        "measure": {"warmup_steps": 1, "steps": 2, "timeout_s": 1},
        "backends": {"mine": {"command": [sys.executable, str(script), str(pid_file)], "cwd": str(tmp_path)}}})
    result = invoke("run", recipe, "--backend", "mine", "--out", tmp_path / "out")
    daemon = int(pid_file.read_text())
    try:
        assert result.exit_code == 1 and "timeout" in result.output, result.output
        assert not alive(daemon), "a daemon of a timed-out command outlived xfw run"
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


def alive(pid: int) -> bool:
    from xfw.contract import lifeline

    return lifeline.process_start_time(pid) is not None


def test_16_a_daemon_an_attached_command_leaves_behind_ends_when_xfw_run_returns(tmp_path):
    recipe, pid_file = daemon_recipe(tmp_path, double=True, linger=0.2)
    result = invoke("run", recipe, "--backend", "mine", "--out", tmp_path / "out")
    daemon = int(pid_file.read_text())
    try:
        assert "Traceback" not in result.output
        assert not alive(daemon), "the command's daemon outlived xfw run"
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


def test_16_killing_xfw_with_sigkill_ends_a_command_child_in_its_own_session(tmp_path):
    from xfw.contract import lifeline

    recipe, pid_file = daemon_recipe(tmp_path, double=False, linger=600)
    xfw = subprocess.Popen([sys.executable, "-m", "xfw.cli", "run", str(recipe), "--backend", "mine", "--out",
                            str(tmp_path / "out")], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and xfw.poll() is None
        time.sleep(0.1)
    daemon = int(pid_file.read_text())
    try:
        os.kill(xfw.pid, signal.SIGKILL)
        xfw.wait(10)
        deadline = time.monotonic() + lifeline.POLL_S + lifeline.GRACE_S + 10
        while alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(daemon), "a child in its own session outlived xfw's SIGKILL"
    finally:
        if alive(daemon):
            os.kill(daemon, signal.SIGKILL)


# --- 21. signals while data is prepared; a closed pipe; the rendezvous --------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_21_a_signal_during_preparation_exits_130_in_one_line_and_leaves_no_temporary(tmp_path, llava, sig):
    paths = with_config(tmp_path, llava, {"bos_token": "<s>", "eos_token": "</s>", "chat_template": LOOP})
    recipe = write_recipe(tmp_path / "r.yaml", llava_json_recipe(paths, tmp_path / "cache",
                                                                 image_root=str(llava["images"].parent)))
    # The template's own 5 s guard raised to 20 s: on a loaded machine the test may not get to send its signal
    # within 5 s of the render starting, and the guard's exit 2 would then be what it sees (it failed so once).
    # Not unbounded: with the guard any render ends, and the signal it got first makes the exit 130.
    # SIGINT at its default first: a suite started in the background (``make test &``, some CI runners) hands
    # its children SIGINT ignored, Python then installs no KeyboardInterrupt for it, and the render ran on to the
    # guard (exit 2 after 20 s: the two loaded full-run failures). A terminal's Ctrl-C finds it at its default.
    unguarded = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "from xfw.run.data import template; template.TIME_S = 20.0; "
                 "from xfw.cli import main; sys.argv[0] = 'xfw'; main()")
    proc = subprocess.Popen([sys.executable, "-c", unguarded, "validate", "--prepare", str(recipe)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list((tmp_path / "cache").glob(".tmp-*")):  # rendering the endless template
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted (Ctrl-C or SIGTERM)"], err
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_21_a_closed_pipe_never_touches_a_runs_status(tmp_path):
    """``xfw run ... 2>&1 | head -n1``: the reader goes away while the run is logging."""
    fakes = ROOT / "tests" / "fakes"
    recipe = write_recipe(tmp_path / "r.yaml", {})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fakes), os.environ.get("PYTHONPATH", "")])}
    xfw = subprocess.Popen([sys.executable, "-m", "xfw.cli", "run", str(recipe), "--backend", "fake", "--python",
                            f"fake={sys.executable}", "--out", str(tmp_path / "out")], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    xfw.stdout.readline()
    xfw.stdout.close()  # head -n1 has its line and exits
    assert xfw.wait(120) == 0
    summary = json.loads((tmp_path / "out" / "tiny-test" / "fake" / "summary.json").read_text())
    assert summary["status"] == "ok", summary["reason"]


# --- 17. nothing written outside --out / --history; paths that cannot be output directories --------------

def fake_args(fake_backend):
    return ["--python", f"fake={fake_backend['fake']}"]


def suite(tmp_path) -> Path:
    write_recipe(tmp_path / "r.yaml", {})
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "backends": ["fake"], "entries": [{"recipe": "r.yaml"}]}))
    return path


@pytest.mark.parametrize("night", ["../../escape", "..", "ABSOLUTE", "a/b", ".", "x" * 300, "n\x00"])
def test_17_a_night_that_is_not_one_plain_name_is_refused_before_anything_is_written(tmp_path, fake_backend, night):
    history = tmp_path / "deep" / "history"
    absolute = tmp_path / "abs-night"  # an absolute --night, inside this test's own directory
    night = str(absolute) if night == "ABSOLUTE" else night
    result = invoke("nightly", suite(tmp_path), "--history", history, "--night", night, *fake_args(fake_backend))
    assert "--night" in one_line_error(result)
    assert not history.exists() and not (tmp_path / "escape").exists() and not absolute.exists()


@pytest.mark.parametrize("kind", ["file", "long", "read-only"])
def test_17_an_out_that_cannot_be_a_directory_is_one_line(tmp_path, fake_backend, kind):
    out = {"file": tmp_path / "afile", "long": tmp_path / ("x" * 300), "read-only": tmp_path / "ro" / "out"}[kind]
    (tmp_path / "afile").write_text("")
    (tmp_path / "ro").mkdir(mode=0o555)
    if kind == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    for command in (["run", write_recipe(tmp_path / "r.yaml", {}), "--backend", "fake"],
                    ["sweep", tmp_path / "r.yaml", "--set", "batch.micro=1,2", "--backends", "fake"],
                    ["nightly", suite(tmp_path), "--history"]):
        flag = [] if command[0] == "nightly" else ["--out"]
        line = one_line_error(invoke(*command, *flag, out, *fake_args(fake_backend)))
        assert "cannot be used as an output directory" in line
    assert invoke("run", tmp_path / "r.yaml", "--backend", "fake", "--out", tmp_path / "ok",
                  *fake_args(fake_backend)).exit_code == 0
    assert "cannot be used as an output directory" in one_line_error(invoke("report", tmp_path / "ok", "--out", out))


def node_parts(tmp_path, fake_backend) -> list[Path]:
    recipe = write_recipe(tmp_path / "r.yaml", {})
    parts = []
    for rank in (0, 1):
        out = tmp_path / f"n{rank}"
        result = invoke("run", recipe, "--backend", "fake", "--set", "parallel.nnodes=2", "--node-rank", rank,
                        "--master-port", 29517, "--out", out, *fake_args(fake_backend))
        assert result.exit_code == 0, result.output
        parts.append(out)
    return parts


def test_17_assemble_into_one_of_its_inputs_is_refused_and_the_input_left_untouched(tmp_path, fake_backend):
    n0, n1 = node_parts(tmp_path, fake_backend)
    before = sorted(str(p) for p in n0.rglob("*"))
    for out in (n0 / "tiny-test" / "all", n1 / "all"):
        line = one_line_error(invoke("assemble", n0, n1, "--out", out))
        assert "is inside the input" in line
    assert sorted(str(p) for p in n0.rglob("*")) == before and not (n1 / "all").exists()
    result = invoke("assemble", n0, n1, "--out", tmp_path / "all")  # outside: assembled
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("flags, words", [(["--master-port", 70000], "--master-port 70000"),
                                          (["--master-port", -1], "--master-port -1"),
                                          (["--master-addr", "no..such"], "not an IP address"),
                                          (["--master-addr", "host name"], "not an IP address"),
                                          (["--master-addr", "xfw-no-such-host.invalid"], "cannot resolve")])
def test_21_a_rendezvous_that_cannot_work_is_refused_before_launch(tmp_path, fake_backend, flags, words):
    result = invoke("run", write_recipe(tmp_path / "r.yaml", {}), "--backend", "fake", "--set", "parallel.nnodes=2",
                    "--out", tmp_path / "out", *flags, *(["--master-port", 29518] if "--master-port" not in flags else []),
                    *fake_args(fake_backend))
    assert words in one_line_error(result)
    assert not (tmp_path / "out" / "tiny-test").exists()


# --- 18. the history file is read whole or refused naming the line and key --------------------------------

def history_row(**changes) -> dict:
    row = {"schema": 1, "night": "2026-11-20", "night_started_utc": "2026-11-20T01:00:00Z", "entry": "e",
           "backend": "torch", "repeat_index": 0, "status": "ok", "reason": "", "ips": 10.0, "workload": "w",
           "knobs": {}, "step_time_median_s": 0.1, "num_measured_steps": 4}
    return {**row, **changes}


@pytest.mark.parametrize("changes, words", [
    ({"night_started_utc": 1732406400}, "night_started_utc must be a UTC time"),
    ({"night_started_utc": None}, "night_started_utc must be a UTC time"),
    ({"night_started_utc": "yesterday"}, "is not a UTC time"),
    ({"night_started_utc": "2099-01-01T00:00:00Z"}, "is in the future"),
    ({"night": "../../x"}, "not a plain directory name"),
    ({"ips": "fast"}, "ips must be a finite number"),
    ({"ips": float("nan")}, "ips must be a finite number"),
    ({"status": None}, "status must be text"),
    ({"knobs": [1]}, "knobs must be an object"),
    ({"repeat_index": True}, "three strings and an integer"),
])
def test_18_a_history_row_of_the_wrong_shape_is_refused_naming_line_and_key(tmp_path, fake_backend, changes, words):
    history = tmp_path / "history"
    history.mkdir()
    lines = [history_row(), history_row(**{"night": "2026-11-21", "night_started_utc": "2026-11-21T01:00:00Z",
                                           **changes})]
    (history / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    result = invoke("nightly", suite(tmp_path), "--history", history, *fake_args(fake_backend))
    line = one_line_error(result)
    assert "history.jsonl:2" in line and words in line, line
    assert not (history / "nights").exists()


def test_18_a_history_holding_unicode_line_separators_in_a_reason_reads_as_written(tmp_path):
    from xfw.report.history import History

    history = History(tmp_path)
    history.upsert([history_row(reason="first\u2028second\x85third")])
    assert [r["reason"] for r in history.rows()] == ["first\u2028second\x85third"]


# --- 19. CSV cells cannot start a formula ------------------------------------------------------------------

def test_19_a_csv_cell_never_starts_a_formula_and_numbers_stay_numbers():
    import csv
    import io

    from xfw.report.table import Table, to_csv

    hostile = ["=HYPERLINK(\"http://x\",\"y\")", "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)", "\tx", "\rx", "\uff1d1+1"]
    table = Table(header=["Model", "Contrast", "=evil header"],
                  cells=[[h, "-59%", "x"] for h in hostile] + [["Tiny", "+3.5", "-1.5e-3"]],
                  records=[{"reason": h, "ips": -3.5} for h in hostile])
    rows = list(csv.reader(io.StringIO(to_csv([table]))))
    for row in rows:
        for cell in row:
            assert not cell.startswith(("=", "+", "@", "\t", "\r", "\uff1d")) or cell in ("+3.5",), cell
            assert not cell.startswith("-") or cell in ("-59%", "-1.5e-3", "-3.5"), cell
    assert rows[0][2] == "'=evil header" and rows[1][0] == "'" + hostile[0] and rows[-1][1:3] == ["+3.5", "-1.5e-3"]


# --- fuzzed: the data formats and the history file -------------------------------------------------------
# Each reader is total: any input prepares (or reads) or is refused with one DataError / UnreadableFile
# line; nothing else escapes. Derandomized, so CI always tries the same inputs.

FUZZ = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
odd_text = st.text(max_size=12) | st.sampled_from(["<image>", "<image>\n<image>", "\ud800", "a\u2028b", "\x00", "",
                                                   "../0.png", "/etc/passwd", "images/0.png", "images/1.png", "0.png"])
json_values = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | odd_text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text, inner, max_size=3),
                           max_leaves=8)
turns = st.fixed_dictionaries({}, optional={"from": st.sampled_from(["human", "gpt", "user", "assistant", "system"])
                                            | json_values, "value": odd_text | json_values})
words = st.sampled_from(["What is shown?", "A red disc.", "<image>\nWhich colour?", "Mostly blue.", "Say hello.",
                         "Hello there.", "<image>\nDescribe it.", "<image>"])
good_turns = st.fixed_dictionaries({"from": st.sampled_from(["human", "gpt"]), "value": words | odd_text})
images = st.sampled_from(["images/0.png", "images/1.png", "images/2.png"])
records = st.fixed_dictionaries(
    {"conversations": st.lists(good_turns, min_size=1, max_size=4) | st.lists(good_turns | turns | json_values,
                                                                               max_size=4)},
    optional={"id": odd_text | json_values, "image": images | st.lists(images | odd_text, max_size=3) | json_values})


@FUZZ
@given(content=st.lists(records, min_size=1, max_size=3) | st.lists(records | json_values, max_size=3) | json_values)
def test_fuzz_any_conversation_json_prepares_or_is_one_line(tmp_path, llava, content):
    paths = conversations(tmp_path, llava, json.dumps(content))
    recipe = write_recipe(tmp_path / "r.yaml", llava_json_recipe(paths, tmp_path / "cache",
                                                                 image_root=str(llava["images"].parent)))
    real._PREPARED.clear()
    result = invoke("validate", "--prepare", recipe)
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 2:
        one_line_error(result)



caption_lines = st.fixed_dictionaries({"file_name": st.sampled_from(["0.png", "1.png", "2.png"]) | odd_text,
                                       "text": words | odd_text}) | json_values


def jsonl_line(value) -> str:
    return json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else value


@FUZZ
@given(lines=st.lists(caption_lines, max_size=4), ending=st.sampled_from(["\n", "\r\n", "", "\u2028", "\n\n"]))
def test_fuzz_any_metadata_jsonl_prepares_or_is_one_line(tmp_path, captions, lines, ending):
    metadata = tmp_path / "metadata.jsonl"
    metadata.write_bytes(ending.join(map(jsonl_line, lines)).encode("utf-8", "surrogatepass"))
    result = captions_validate(tmp_path, {**captions, "jsonl": metadata}, image_root=str(captions["jsonl"].parent))
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 2:
        one_line_error(result)


FRAGMENTS = ["{{ bos_token }}", "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}",
             "{% if add_generation_prompt %}ASSISTANT:{% endif %}", "{{ messages[0].content | upper }}", "{%",
             "{{ x.y.z }}", "{{ raise_exception('no') }}", "{{ messages | nosuch }}", "{{ 1 / 0 }}", "{{ 'a' * 3 }}",
             "{{ range(3) | list }}", "{{ messages.__class__ }}", "{% set n = namespace(i=0) %}{{ n.i }}", "}}"]
configs = st.fixed_dictionaries({}, optional={
    "bos_token": st.sampled_from(["<s>", "", None]) | json_values, "eos_token": st.sampled_from(["</s>", None]) | json_values,
    "pad_token": st.fixed_dictionaries({"content": st.sampled_from(["</s>", "<unk>"]) | json_values}) | json_values,
    "chat_template": st.lists(st.sampled_from(FRAGMENTS), max_size=4).map("".join) | json_values})


@settings(FUZZ, max_examples=150)
@given(config=configs)
def test_fuzz_any_tokenizer_config_prepares_or_is_one_line(tmp_path, llava, config):
    paths = {**llava, "tokenizer": tmp_path / "tok"}
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tok" / "tokenizer.json").write_bytes((llava["tokenizer"] / "tokenizer.json").read_bytes())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    real._PREPARED.clear()
    result = llava_validate(tmp_path, paths)
    assert result.exit_code in (0, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 2:
        one_line_error(result)


history_values = st.fixed_dictionaries({}, optional={k: json_values | st.sampled_from(
    ["2026-11-20T01:00:00Z", "2099-01-01T00:00:00Z", "ok", "oom", 1.5, 0, None]) for k in (
    "night", "night_started_utc", "entry", "backend", "repeat_index", "status", "ips", "memory_bytes",
    "memory_source", "step_time_p10_s", "step_time_p90_s", "step_time_median_s", "num_measured_steps", "workload",
    "knobs", "mfu", "reason")})


@FUZZ
@given(changes=st.lists(history_values, min_size=1, max_size=3), junk=st.sampled_from(["", "{", "[]", "\u2028", "null"]))
def test_fuzz_any_history_file_reads_and_judges_or_is_one_line(tmp_path, changes, junk):
    from xfw.contract.atomic import UnreadableFile
    from xfw.report.history import History
    from xfw.report.verdicts import RegressionPolicy, evaluate

    rows = [history_row(**{"night": f"2026-11-{i + 10}", "night_started_utc": f"2026-11-{i + 10}T01:00:00Z", **change})
            for i, change in enumerate(changes)]
    text = "".join(json.dumps(r) + "\n" for r in rows) + junk
    (tmp_path / "history.jsonl").write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        read = History(tmp_path).rows()
    except UnreadableFile as err:
        assert "\n" not in str(err) and "history.jsonl" in str(err), err
        return
    for night in {r["night"] for r in read}:
        evaluate(read, night, RegressionPolicy())


def test_19_a_commands_stderr_starting_with_a_formula_is_text_in_report_csv(tmp_path):
    import csv

    script = tmp_path / "evil.py"
    script.write_text("import sys\nprint('=HYPERLINK(\"http://evil\",\"click\")', file=sys.stderr)\nsys.exit(3)\n")
    recipe = write_recipe(tmp_path / "attach.yaml", {
        "measure": {"warmup_steps": 1, "steps": 2, "timeout_s": 60},
        "backends": {"mine": {"command": [sys.executable, str(script)], "cwd": str(tmp_path)}}})
    result = invoke("run", recipe, "--backend", "mine", "--out", tmp_path / "out")
    assert result.exit_code == 1, result.output
    with open(tmp_path / "out" / "report.csv", newline="") as f:
        cells = [cell for row in csv.reader(f) for cell in row]
    assert any("HYPERLINK" in c for c in cells)
    assert not [c for c in cells if c.startswith(("=", "+", "@", "\t", "\r"))], cells


def test_18_a_row_xfw_writes_is_always_one_it_reads_back(tmp_path):
    from xfw.report.history import History

    history = History(tmp_path)
    history.upsert([history_row(ips=float("inf"), loss_last=float("nan"), framework_version=3.0, mfu="high")])
    (row,) = history.rows()
    assert row["ips"] is None and row["loss_last"] is None and row["framework_version"] == "3.0" and row["mfu"] is None
