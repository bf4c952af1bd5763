"""A backend's --describe answer is reused only for the same question (xfw.run.launch.described): the same
interpreter, adapter files, installed packages and environment; nothing is kept unless XFW_DESCRIBE_CACHE is set."""

import os
import time

from conftest import FAKES
from xfw.run.launch import described, launcher


def test_the_same_question_is_answered_from_the_cache_and_any_change_asks_again(tmp_path, monkeypatch):
    adapter = tmp_path / "adapters" / "x" / "xfw_x"
    adapter.mkdir(parents=True)
    (adapter / "__main__.py").write_text("print('{}')\n")
    monkeypatch.setenv(described.VARIABLE, str(tmp_path / "kept"))
    first = described.cache_file("/venv/bin/python", "xfw_x", adapter.parent)
    assert first == described.cache_file("/venv/bin/python", "xfw_x", adapter.parent)
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")  # volatile: the same question
    assert described.cache_file("/venv/bin/python", "xfw_x", adapter.parent) == first
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")  # another worker of the same test run: the same question
    assert described.cache_file("/venv/bin/python", "xfw_x", adapter.parent) == first
    assert described.cache_file("/other/bin/python", "xfw_x", adapter.parent) != first
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # another environment: asked again
    changed_env = described.cache_file("/venv/bin/python", "xfw_x", adapter.parent)
    assert changed_env != first
    time.sleep(0.01)
    (adapter / "__main__.py").write_text("print('{\"changed\": 1}')\n")  # the adapter edited: asked again
    assert described.cache_file("/venv/bin/python", "xfw_x", adapter.parent) != changed_env
    described.keep(first, {"backend": "x"})
    assert described.recall(first) == {"backend": "x"}
    first.write_text("not json")
    assert described.recall(first) is None  # unreadable: the adapter is asked again
    monkeypatch.delenv(described.VARIABLE)
    assert described.cache_file("/venv/bin/python", "xfw_x", adapter.parent) is None  # users: never kept


def test_describe_backend_keeps_a_real_answer_and_recalls_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(FAKES), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(described.VARIABLE, str(tmp_path / "kept"))
    backend = launcher.resolve_backend("fake", {"fake": os.sys.executable})
    answer = launcher.describe_backend(backend)
    assert answer["framework"] == "fake"
    (kept,) = (tmp_path / "kept").glob("*.json")
    described.keep(kept, {**answer, "framework_version": "recalled"})
    assert launcher.describe_backend(backend)["framework_version"] == "recalled"
