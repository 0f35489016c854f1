"""Drafter training under ``torchrun`` (gloo on this CPU): 2 processes follow the 1-process loss curve with
the same global batch, checkpoints resume at either process count, target features are taken chunk by chunk
from the chosen layers only."""
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dllm_core.drafters import load_drafter
from dllm_core.drafters.target import load_target, target_features
from dllm_core.train.dflash import DFlashTrainConfig, run

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "models" / "qwen3-tasks"
pytestmark = pytest.mark.skipif(not (TARGET / "config.json").is_file(), reason="models/qwen3-tasks not shipped")

# the shipped drafter's sizes (models/dflash-qwen3-tasks: 3 layers, blocks of 16), a short run
BASE = dict(target=str(TARGET), tasks="arithmetic;sort", num_prompts=16, max_new_tokens=32, layers=3,
            block_size=16, blocks_per_seq=4, batch_size=8, steps=6, lr=3e-3, warmup=2, save_every=1,
            eval_every=1, keep_data=True)


def torchrun(n: int, cli: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", "-m",
           "dllm_core.cli", *cli]
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def flags(cfg: DFlashTrainConfig) -> list[str]:
    out = ["train-dflash", "--target", cfg.target, "--out", cfg.out, "--threads", "1"]
    for k in ("tasks", "num_prompts", "max_new_tokens", "layers", "block_size", "blocks_per_seq", "batch_size",
              "steps", "lr", "warmup", "save_every", "eval_every", "grad_accum", "time_limit"):
        out += ["--" + k.replace("_", "-"), str(getattr(cfg, k))]
    return out + (["--keep-data"] if cfg.keep_data else []) + (["--resume"] if cfg.resume else [])


def losses(out) -> list[float]:
    """The loss of every step (the log's per-step records; eval every step)."""
    rows = map(json.loads, (Path(out) / "train_log.jsonl").read_text().splitlines())
    return [r["step_loss"] for r in rows if "step_loss" in r]


def weights(out) -> dict:
    return load_drafter(out).state_dict()


def same_weights(a, b) -> None:
    """Equal to float32 reduction-order noise: gradients summed in another order, amplified by Adam's
    normalisation over 6 steps at lr 3e-3 (measured: <= 2e-5 on weights of about 0.1)."""
    wa, wb = weights(a), weights(b)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The 1-process reference run (its regenerated data is kept for the other runs)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("single")
    cfg = DFlashTrainConfig(out=str(out), **BASE)
    run(cfg)
    return cfg


def with_data(single, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(single.out) / "regenerated.pt", out / "regenerated.pt")
    return out


def test_two_processes_follow_one_process(single, tmp_path):
    """2 gloo processes x 2 micro-batches = the same global batch of 8: same loss at every step, same weights;
    the prompts regenerated in two shards are the one-process data."""
    cfg = replace(single, out=str(tmp_path / "ddp"), grad_accum=2)
    torchrun(2, flags(cfg), tmp_path)
    one, two = losses(single.out), losses(cfg.out)
    assert len(one) == len(two) == 6 and one[-1] < one[0]
    assert two == pytest.approx(one, rel=1e-5)
    same_weights(single.out, cfg.out)
    a, b = (torch.load(Path(d) / "regenerated.pt", weights_only=True) for d in (single.out, cfg.out))
    assert a == b
    assert not (Path(cfg.out) / "train_state.pt").exists()


def test_checkpoints_resume_at_the_other_process_count(single, tmp_path):
    """Stopped after a step (--time-limit) at two processes, resumed for one step at one process and stopped again,
    resumed to the end at two (both directions of a change in process count): the weights of the uninterrupted
    one-process run."""
    cfg = replace(single, out=str(with_data(single, tmp_path / "run")), time_limit=1e-3)
    torchrun(2, flags(cfg), tmp_path)
    assert (Path(cfg.out) / "train_state.pt").is_file() and len(losses(cfg.out)) == 1
    torchrun(1, flags(replace(cfg, resume=True)), tmp_path)
    assert len(losses(cfg.out)) == 2
    torchrun(2, flags(replace(cfg, time_limit=0.0, resume=True)), tmp_path)
    assert losses(cfg.out) == pytest.approx(losses(single.out), rel=1e-5)
    same_weights(single.out, cfg.out)


def test_uneven_split_is_a_clear_error(single, tmp_path):
    with pytest.raises(ValueError, match=r"--batch-size 8 must be divisible by processes x --grad-accum = 1 x 3"):
        run(replace(single, out=str(with_data(single, tmp_path / "odd")), grad_accum=3))


def test_target_features_are_the_chosen_hidden_states_chunk_by_chunk():
    target = load_target(TARGET)
    n = target.config.num_hidden_layers
    tokens = torch.randint(0, 400, (3, 37))
    hs = target(tokens, output_hidden_states=True).hidden_states  # entry i + 1 = layer i (the last normed)
    for ids in ((1, 3), (0, n - 1), (n - 1,)):
        want = torch.cat([hs[i + 1] for i in ids], -1)
        for chunk in (0, 5, 16, 37, 100):
            torch.testing.assert_close(target_features(target, tokens, ids, chunk), want, rtol=1e-4, atol=1e-5)


def test_tokenswift_heads_two_processes_follow_one_process(tmp_path):
    """The heads trainer under torchrun: continuations and hidden states in two shards, 2 x 2 micro-batches
    of the global 64 positions = the one-process run."""
    from dllm_core.drafters.tokenswift import load_heads
    from dllm_core.drafters.tokenswift.train import TokenSwiftTrainConfig, run as run_heads

    cfg = TokenSwiftTrainConfig(target=str(TARGET), out=str(tmp_path / "one"), tasks="count:span=40", num_prompts=4,
                                gen_tokens=64, batch=64, steps=4, warmup=1, save_every=1, eval_every=1,
                                keep_data=True)
    run_heads(cfg)
    two = tmp_path / "two"
    cli = ["train-tokenswift", "--target", cfg.target, "--out", str(two), "--tasks", cfg.tasks, "--num-prompts", "4",
           "--gen-tokens", "64", "--batch", "64", "--steps", "4", "--warmup", "1", "--save-every", "1",
           "--eval-every", "1", "--grad-accum", "2", "--keep-data", "--threads", "1"]
    torchrun(2, cli, tmp_path)
    assert losses(two) == pytest.approx(losses(cfg.out), rel=1e-5) and len(losses(two)) == 4
    a, b = torch.load(two / "tokenswift_data.pt", weights_only=True), torch.load(tmp_path / "one" / "tokenswift_data.pt",
                                                                                  weights_only=True)
    assert a == b
    for pa, pb in zip(load_heads(cfg.out).parameters(), load_heads(two).parameters()):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-4)
