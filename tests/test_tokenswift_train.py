"""``dllm train-tokenswift`` (training improves the heads, ``--resume`` equals an uninterrupted run) and
``dllm bench-long`` (report, markdown + PNG) on a tiny local Qwen3 target."""
import json

import pytest
import torch

from dllm_core.drafters.tokenswift import train as ts_train


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from dllm_core.drafters.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("ts_train_target"))


def _cfg(target_dir, out, **kw):
    base = dict(target=str(target_dir), out=str(out), tasks="count:span=40", num_prompts=4, gen_tokens=96,
                batch=64, steps=24, lr=3e-3, warmup=2, save_every=8, eval_every=0)
    return ts_train.TokenSwiftTrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def trained(target_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ts_heads")
    summary = ts_train.run(_cfg(target_dir, out))
    return out, summary


def test_training_beats_the_untrained_heads(target_dir, trained):
    from dllm_core.drafters.target import load_target
    from dllm_core.drafters.tokenswift import HeadsConfig, TokenSwiftHeads, load_heads
    from dllm_core.tokenizer import load_tokenizer

    out, summary = trained
    assert not (out / "train_state.pt").exists() and not (out / "tokenswift_data.pt").exists()
    target = load_target(target_dir)
    cfg = _cfg(target_dir, out)
    data = ts_train.build_data(cfg, target, load_tokenizer(target_dir))
    hidden, tokens, start, end = ts_train.hidden_states(target, data)
    seq, pos = ts_train.positions_at(-1, cfg, start, end)
    lm = target.get_output_embeddings()
    fresh = TokenSwiftHeads(HeadsConfig.for_target(target.config))  # zero init: every head = the LM head
    with torch.no_grad():
        before, _ = ts_train.heads_loss(fresh, lm, hidden, tokens, seq, pos, cfg)
        after, _ = ts_train.heads_loss(load_heads(out), lm, hidden, tokens, seq, pos, cfg)
    assert float(after) < 0.8 * float(before)
    assert summary["eval_loss"] == pytest.approx(float(after), rel=1e-4)


def test_resume_equals_uninterrupted(target_dir, trained, tmp_path, monkeypatch):
    from dllm_core.drafters.tokenswift import load_heads

    out = tmp_path / "resumed"
    real, calls = ts_train.heads_loss, {"n": 0}

    def crash_at_13(*a, **k):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ts_train, "heads_loss", crash_at_13)
    with pytest.raises(KeyboardInterrupt):
        ts_train.run(_cfg(target_dir, out))
    assert (out / "train_state.pt").is_file() and (out / "tokenswift_data.pt").is_file()
    monkeypatch.setattr(ts_train, "heads_loss", real)
    with pytest.raises(ValueError, match="pass --resume"):
        ts_train.run(_cfg(target_dir, out))
    summary = ts_train.run(_cfg(target_dir, out, resume=True))
    assert summary["start"] == 8
    a, b = load_heads(trained[0]), load_heads(out)
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb)


def test_bench_long_cli(target_dir, trained, tmp_path, capsys):
    from dllm_core.cli import main

    doc, js = tmp_path / "ts.md", tmp_path / "ts.json"
    rc = main(["bench-long", "--target", str(target_dir), "--heads", str(trained[0]), "--task", "count:span=40",
               "--lengths", "60,120", "--draft", "shared,dynamic", "--penalties", "1.0,1.3",
               "--penalty-window", "32", "--budget", "48", "--sinks", "4", "--json", str(js), "--doc", str(doc)])
    assert rc == 0
    report = json.loads(js.read_text())
    assert [(r["draft"], r["penalty"]) for r in report["rows"]] == [("shared", 1.0), ("dynamic", 1.0),
                                                                  ("shared", 1.3), ("dynamic", 1.3)]
    for r in report["rows"]:
        assert r["identical"] and r["tokens"] == 120
        assert set(r["speedup"]) == {"60", "120"} and all(v > 0 for v in r["speedup"].values())
        assert 0 < r["alpha"] <= 1 and r["tokens_per_verify"] >= 1
        assert 0 < r["distinct_4"] <= 1
    assert report["rows"][1]["tokens_per_forward"] * 2 == pytest.approx(report["rows"][1]["tokens_per_verify"],
                                                                        abs=0.01)
    text = doc.read_text()
    assert "| shared | 1.0 | yes |" in text and "speedup @120" in text
    assert (tmp_path / "tokenswift_speedup.png").read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    assert main(["bench-long", "--target", str(target_dir), "--heads", str(trained[0]), "--draft", "eagle"]) == 2
    assert "--draft must be among ['shared', 'dynamic']" in capsys.readouterr().err
