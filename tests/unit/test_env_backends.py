"""``xfw env`` with no --backends: paddle and torch always (said NOT AVAILABLE when missing), then every
other adapter whose environment exists, so a machine that ran scripts/setup_jax.sh sees jax listed."""

from xfw.run.launch.instances import env_backends


def _adapter(root, name, env=False):
    (root / "adapters" / name / f"xfw_{name}").mkdir(parents=True)
    if env:
        (root / ".venv" / name).mkdir(parents=True)


def test_an_adapter_with_its_environment_is_listed_after_paddle_and_torch(tmp_path):
    for name in ("paddle", "torch"):
        _adapter(tmp_path, name, env=True)
    _adapter(tmp_path, "jax", env=True)
    assert env_backends(tmp_path) == ["paddle", "torch", "jax"]


def test_an_adapter_without_its_environment_is_not_listed_but_paddle_and_torch_always_are(tmp_path):
    _adapter(tmp_path, "jax")
    assert env_backends(tmp_path) == ["paddle", "torch"]
