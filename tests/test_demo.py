"""``dllm demo`` (the main job, ``make demo``): generations marked against the answers, then the policy table."""
import pytest

from dllm_core.bench import DEFAULT_MODEL, LONG_MODEL

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "config.json").is_file(), reason="models/llada-tasks not shipped")


def test_demo_shows_marked_generations_and_the_table(capsys):
    from dllm_core.cli import main

    assert main(["demo", "--n", "2", "--tasks", "arithmetic;sort", "--samplers", "threshold:tau=0.9",
                 "--caches", "none;dual", "--no-long", "--no-llada2"]) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("> [")]
    assert len(lines) == 4 and lines[0].startswith("> [arithmetic, 24-token canvas]")
    marks = [ln for ln in out.splitlines() if ln.endswith(("[ok]", "[WRONG]"))]
    assert len(marks) == 4 and sum(m.endswith("[ok]") for m in marks) >= 3  # the shipped model solves them
    table = [ln for ln in out.splitlines() if ln.startswith("| `")]
    assert [r.split(" | ")[:2] for r in table] == [["| `low_confidence`", "`none`"], ["| `threshold:tau=0.9`", "`none`"],
                                                  ["| `threshold:tau=0.9`", "`dual`"]]
    assert "long answers" not in out and LONG_MODEL.name == "llada-long"
    assert "caches pay on long responses" in out  # why a cache is slower than its sampler alone here


def test_demo_llada2_part(capsys):
    """With the shipped LLaDA2 task model the demo adds its part: generations and its table (exact prefix cache)."""
    from dllm_core.cli import main
    from dllm_core.demo import LLADA2_MODEL

    if not (LLADA2_MODEL / "config.json").is_file():
        pytest.skip("models/llada2-tasks not shipped")
    assert main(["demo", "--n", "2", "--tasks", "arithmetic", "--samplers", "threshold:tau=0.9", "--caches", "none",
                 "--no-long"]) == 0
    out = capsys.readouterr().out
    part = out[out.index("LLaDA2MoeModelLM"):]
    assert sum(ln.endswith("[ok]") for ln in part.splitlines()) >= 3
    lines = part.splitlines()
    head = [c.strip() for c in next(ln for ln in lines if ln.startswith("| sampler")).split("|")]
    row = [c.strip() for c in next(ln for ln in lines if ln.startswith("| `threshold:tau=0.9` | `prefix`")).split("|")]
    assert float(row[head.index("mean acc")]) >= 0.75 and float(row[head.index("work")]) < 0.5
