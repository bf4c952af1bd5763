"""Sides measured on different node types are flagged first on their row; a nightly compares a row only with
nights measured on the same node type (issue 40, "fairness on a cluster")."""

from test_compare_render import result
from test_nightly_logic import row

from xfw.report.compare import compare_runs
from xfw.report.results import node_type
from xfw.report.verdicts import RegressionPolicy, evaluate

H800 = {"host": {"hostname": "n1", "cpu": "Intel Xeon 8468"}, "backend": {"device_name": "NVIDIA H800"}}


def on(node_env: dict, r):
    r.env = node_env
    return r


def test_a_node_type_is_its_accelerator_and_host_cpu_never_its_hostname():
    assert node_type(H800) == "NVIDIA H800 (host Intel Xeon 8468)"
    assert node_type({**H800, "host": {**H800["host"], "hostname": "n2"}}) == node_type(H800)
    cpu_only = {"host": {"cpu": "Intel Xeon"}, "backend": {"device_name": "Intel Xeon"}}
    assert node_type(cpu_only) == "Intel Xeon" and node_type({}) is None
    assert node_type(H800, {"device_name": "NVIDIA A800"}) == "NVIDIA A800 (host Intel Xeon 8468)"  # as applied


def test_sides_on_two_node_types_are_flagged_first_and_one_type_is_not():
    a800 = {**H800, "backend": {"device_name": "NVIDIA A800"}}
    (mixed,) = compare_runs([on(H800, result("paddle", 82.0)), on(a800, result("torch", 65.0))], ["paddle", "torch"])
    assert mixed.warnings[0].startswith("the runs measured on different node types (paddle: NVIDIA H800")
    assert "torch: NVIDIA A800" in mixed.warnings[0] and "--constraint" in mixed.warnings[0]
    two_nodes = {**H800, "host": {**H800["host"], "hostname": "n2"}}
    (same,) = compare_runs([on(H800, result("paddle", 82.0)), on(two_nodes, result("torch", 65.0))],
                           ["paddle", "torch"])
    assert not any("node types" in w for w in same.warnings)
    (repeats,) = compare_runs([on(H800, result("paddle", 82.0)), on(a800, result("paddle", 80.0, repeat=1)),
                               on(H800, result("torch", 65.0))], ["paddle", "torch"])
    assert "paddle: NVIDIA A800 (host Intel Xeon 8468), NVIDIA H800" in repeats.warnings[0]  # one side's repeats


def test_a_night_on_another_node_type_is_not_judged_against_the_others():
    policy = RegressionPolicy()
    rows = [{**row(n, ips=100.0), "node_type": "H800"} for n in ("n1", "n2")]
    slow = {**row("n3", ips=50.0), "node_type": "A800"}
    (verdict,) = [v for v in evaluate(rows + [slow], "n3", policy) if v.metric == "ips"]
    assert verdict.verdict == "incomparable" and "another node type (H800; this night: A800)" in verdict.note
    same_type = {**row("n3", ips=50.0), "node_type": "H800"}
    assert any(v.verdict == "regression" for v in evaluate(rows + [same_type], "n3", policy))
    before_types = [row(n, ips=100.0) for n in ("n1", "n2")]  # history from before node types were recorded
    assert any(v.verdict == "regression" for v in evaluate(before_types + [same_type], "n3", policy))
