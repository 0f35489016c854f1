"""``dllm bench --quick`` on the shipped task model: files, table, and the invariants of the numbers."""
import json
import subprocess
import sys

import pytest

from dllm_core.bench import DEFAULT_MODEL, combos, markdown, profile_markdown, settings_markdown

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="models/llada-tasks not shipped")


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    from dllm_core.cli import main

    out = tmp_path_factory.mktemp("bench")
    rc = main(["bench", "--quick", "--samplers", "low_confidence;threshold:tau=0.9;slowfast",
               "--caches", "none;dual:every=1;dllm:kp=50,kr=7,rho=0.25", "--out", str(out), "--no-progress"])
    assert rc == 0
    return out, json.loads((out / "bench.json").read_text())


def test_writes_table_json_and_plot(quick):
    out, res = quick
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = res["rows"]
    assert [(r["sampler"], r["cache"]) for r in rows] == combos(
        ["low_confidence", "threshold:tau=0.9", "slowfast"], ["none", "dual:every=1", "dllm:kp=50,kr=7,rho=0.25"])
    assert (out / "bench.md").read_text().strip() == settings_markdown(res["canvas"]) + "\n\n" + markdown(
        rows) + "\n\n" + profile_markdown(rows, res["bare_forward_ms"])
    labels = ["arithmetic", "sort", "retrieval:pairs=30"]
    assert res["tasks"] == labels and res["n"] == 4 and list(res["canvas"]) == labels
    assert res["canvas"]["retrieval:pairs=30"]["shots"] == 0 and res["canvas"]["sort"]["gen_length"] == 24
    assert 300 < res["canvas"]["retrieval:pairs=30"]["prompt_tokens_p50"] <= res["canvas"]["retrieval:pairs=30"][
        "prompt_tokens_p90"] <= res["canvas"]["retrieval:pairs=30"]["prompt_tokens"]
    assert all(list(r["accuracy"]) == labels for r in rows)
    assert res["command"].startswith("dllm bench --model ") and "--tasks 'arithmetic;sort;retrieval:pairs=30'" in res["command"]


def test_vanilla_row_and_exact_cache(quick):
    rows = {(r["sampler"], r["cache"]): r for r in quick[1]["rows"]}
    van = rows["low_confidence", "none"]
    assert van["speedup"] == 1.0 and van["agreement"] == 1.0 and van["work"] == 1.0
    assert van["nfe_per_token"] == 1.0  # vanilla: steps == gen_length
    assert van["forwards"] == 24 + 24 + 8  # one batch per task, gen_length forwards each
    assert van["tokens_per_forward"] == 1.0 and van["predicted"] == 1.0 and van["efficiency"] == 1.0
    for r in rows.values():  # the profile's split: speedup = fewer forwards x cheaper forwards
        fewer, cheaper = van["forwards"] / r["forwards"], van["ms_per_forward"] / r["ms_per_forward"]
        assert fewer * cheaper == pytest.approx(r["speedup"], rel=1e-9)
        # efficiency: measured over predicted (fewer forwards x forwards cheaper by the work fraction)
        assert r["predicted"] == pytest.approx(fewer / r["work"], rel=1e-9)
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["predicted"], rel=1e-9)
        assert r["tokens_per_forward"] == pytest.approx(1 / r["nfe_per_token"], rel=1e-9)
    exact = rows["low_confidence", "dual:every=1"]  # refresh every step = exact: same tokens as vanilla
    assert exact["agreement"] == 1.0 and exact["accuracy"] == van["accuracy"]
    for c in ("none", "dllm:kp=50,kr=7,rho=0.25"):
        assert rows["threshold:tau=0.9", c]["nfe_per_token"] < 1.0  # parallel decoding saves forwards
    assert rows["low_confidence", "dllm:kp=50,kr=7,rho=0.25"]["work"] < 1.0


def test_vanilla_accuracy_matches_dllm_eval(quick):
    """The bench's vanilla accuracy is the same measurement ``dllm eval`` makes."""
    from dllm_core.tasks import parse_tasks
    from dllm_core.tasks.evaluate import evaluate

    runs = evaluate(DEFAULT_MODEL, parse_tasks("arithmetic;sort;retrieval:pairs=30"), n=4)
    van = quick[1]["rows"][0]
    assert {k: r.accuracy for k, r in runs.items()} == van["accuracy"]


def test_bad_spec_is_a_clear_error(tmp_path):
    p = subprocess.run([sys.executable, "-m", "dllm_core.cli", "bench", "--quick", "--samplers", "fastest",
                        "--out", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2
    assert "--sampler: unknown policy 'fastest'; allowed:" in p.stderr
    p = subprocess.run([sys.executable, "-m", "dllm_core.cli", "bench", "--n", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--n must be >= 1, got 0" in p.stderr
    p = subprocess.run([sys.executable, "-m", "dllm_core.cli", "bench", "--long", "300", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--long must be one of [256, 512], got 300" in p.stderr
    p = subprocess.run([sys.executable, "-m", "dllm_core.cli", "bench", "--one-line", "--out", str(tmp_path)],
                       capture_output=True, text=True)
    assert p.returncode == 2 and "--one-line goes with --long 256 or --long 512" in p.stderr


def test_progress_outside_a_terminal_writes_plain_timed_lines():
    """Not a terminal (CI, a log): no carriage returns; status changes do not force lines; one line at the
    start and one at the end when the interval is long; every update when it is zero."""
    import io

    from dllm_core.progress import progress

    def lines(every_s):
        buf = io.StringIO()
        bar = progress(range(200), desc="bench", file=buf, every_s=every_s)
        for i in bar:
            bar.set_postfix_str(f"item {i}")
        return buf.getvalue()

    slow, fast = lines(3600.0), lines(0.0)
    assert "\r" not in slow + fast and slow.endswith("\n")
    assert len(slow.splitlines()) == 2 and "200/200" in slow.splitlines()[-1]
    assert len(fast.splitlines()) > 100
