"""Training commands: exact resume, clear errors, and checkpoints the loaders / CLI accept."""
import json

import pytest
import torch
from safetensors.torch import load_file

from dllm_core.cli import main

TINY = ["--batch", "3,3,1", "--dim", "32", "--layers", "2", "--heads", "2", "--ffn", "64", "--max-len", "2048",
        "--warmup", "2", "--save-dtype", "float32", "--tasks", "arithmetic;sort;retrieval:pairs=6"]


def train(out, *extra):
    assert main(["train-mdm", "--out", str(out), *TINY, *extra]) == 0


def test_resume_equals_uninterrupted_run(tmp_path):
    train(tmp_path / "a", "--steps", "4")
    train(tmp_path / "b", "--steps", "4", "--time-limit", "1e-9")  # stops (and checkpoints) after step 1
    assert (tmp_path / "b" / "train_state.pt").is_file()
    train(tmp_path / "b", "--steps", "4", "--resume")
    assert not (tmp_path / "b" / "train_state.pt").exists()  # finished runs leave only the HF layout
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    log = [json.loads(line) for line in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [(r["start"], r["steps"]) for r in log if "start" in r] == [(0, 1), (1, 4)]


def test_autocast_bf16_follows_the_fp32_run_and_resumes_either_way(tmp_path):
    """--autocast bfloat16 runs the losses in bf16 (fp32 master weights): the loss curve stays within bf16
    rounding of the fp32 one, yet the weights differ (the bf16 path really ran); precision is a runtime setting,
    so a checkpoint resumes under the other one."""
    train(tmp_path / "a", "--steps", "4")
    train(tmp_path / "b", "--steps", "4", "--autocast", "bfloat16")
    end = lambda d: json.loads((d / "train_log.jsonl").read_text().splitlines()[-1])["loss_ema"]
    assert end(tmp_path / "a") == pytest.approx(end(tmp_path / "b"), rel=0.01)
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(b[k].dtype == torch.float32 for k in b)
    assert not all(torch.equal(a[k], b[k]) for k in a)
    train(tmp_path / "c", "--steps", "4", "--autocast", "bfloat16", "--time-limit", "1e-9")
    train(tmp_path / "c", "--steps", "4", "--resume")
    assert not (tmp_path / "c" / "train_state.pt").exists()


def test_resume_refuses_other_settings_and_overwrites(tmp_path, capsys):
    train(tmp_path, "--steps", "4", "--time-limit", "1e-9")
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "4", "--lr", "0.01", "--resume"]) == 2
    assert "was written with different settings (lr)" in capsys.readouterr().err
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "4"]) == 2
    assert "holds a checkpoint (train_state.pt); pass --resume" in capsys.readouterr().err


@pytest.mark.parametrize("args,msg", [
    (["--batch", "3,3"], "--batch needs one positive int per task (3)"),
    (["--dim", "33"], "--dim 33 must be divisible by --heads 2 into an even head size"),
    (["--dim", "30"], "--dim 30 must be divisible by --heads 2 into an even head size"),
    (["--device", "tpu"], "--device must be one of ['cpu', 'cuda']"),
    (["--tasks", "poetry"], "--tasks: unknown policy 'poetry'"),
    (["--autocast", "fp8"], "--autocast must be one of ['none', 'bfloat16'], got 'fp8'"),
])
def test_bad_options(tmp_path, capsys, args, msg):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", *args]) == 2
    assert msg in capsys.readouterr().err


def test_mdm_checkpoint_is_a_llada_checkpoint(tmp_path, capsys):
    from dllm_core import load_model

    train(tmp_path, "--steps", "2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LLaDAModelLM"] and cfg["mask_token_id"] == 5
    assert "model.transformer.blocks.1.ff_proj.weight" in load_file(tmp_path / "model.safetensors")
    assert load_model(tmp_path).args.n_layers == 2
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "Sort: 3 1", "--chat", "--gen-length", "8",
                 "--block-length", "8", "--steps", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nfe"] == 8


def test_ar_checkpoint_is_a_qwen3_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    assert main(["train-ar", "--out", str(tmp_path), *TINY[:-2], "--tasks", "sort;count:min_span=1,span=3",
                 "--batch", "2,2", "--steps", "2", "--kv-heads", "1"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_key_value_heads"] == 1
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [4, 1]
    m = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    assert type(m).__name__ == "Qwen3ForCausalLM" and m.config.tie_word_embeddings


def _spy_inputs(module):
    seen = []
    return seen, module.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))


@pytest.mark.parametrize("frac", [0.0, 1.0])
def test_prompt_noise_rows(llada, frac):
    """--prompt-noise: 0 keeps every prompt clean (SFT); 1 noises whole rows (pre-training loss, prompt
    included) but never the left padding; the loss is the 1/t-weighted CE normalised per row."""
    from dllm_core.train.mdm import mdm_loss

    model = llada
    B, P, T, mask = 8, 6, 14, model.args.mask_token_id
    x = torch.randint(6, 100, (B, T))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[:, :2] = False  # left padding
    pos = (keep.cumsum(-1) - 1).clamp_min(0)
    seen, hook = _spy_inputs(model.embed)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(0), True, frac)
    hook.remove()
    noisy = seen[0] == mask
    assert not noisy[:, :2].any() and noisy[:, P:].any()
    assert noisy[:, 2:P].any() == (frac == 1.0)
    assert torch.isfinite(loss) and loss > 0


def test_block_noise_rows(llada):
    """--block-noise 1: each row keeps a clean prefix of whole blocks, masks part of one block (the only
    scored one) and every later block whole; the block is one the answer reaches (up to the block holding
    its first padding token); the loss is the 1/t-weighted CE of that block over its length."""
    import torch.nn.functional as F

    from dllm_core.train.mdm import mdm_loss, noise_levels

    model, (B, P, G, blk, pad, mask) = llada, (64, 3, 16, 4, 1, llada.args.mask_token_id)
    x = torch.randint(6, 100, (B, P + G))
    ends = torch.arange(B) % (G + 1)  # answer lengths 0..G
    x[:, P:] = torch.where(torch.arange(G)[None] < ends[:, None], x[:, P:], pad)
    keep = torch.ones(B, P + G, dtype=torch.bool)
    pos = torch.arange(P + G).expand(B, -1)
    seen, hook = _spy_inputs(model.embed)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(1), True, 0.0, 1.0,
                    blk, pad)
    hook.remove()
    noisy = seen[0][:, P:] == mask  # [B, G]
    assert not (seen[0][:, :P] == mask).any()
    gen = torch.Generator().manual_seed(1)  # mdm_loss's draws, in order
    t = noise_levels(B, gen, "cpu")
    torch.rand(B, 1, generator=gen)
    torch.rand(B, P + G, generator=gen)
    torch.rand(B, 1, generator=gen)
    k = (torch.rand(B, generator=gen) * torch.clamp(ends // blk + 1, max=G // blk)).long()
    want, drawn = 0.0, set()
    logits = model(seen[0], pos, keep[:, None, None])
    for r in range(B):
        a, b = int(k[r]) * blk, int(k[r]) * blk + blk
        assert a <= ends[r] and not noisy[r, :a].any() and noisy[r, b:].all(), (r, a, noisy[r])
        drawn.add(int(k[r]))
        ce = F.cross_entropy(logits[r, P + a:P + b], x[r, P + a:P + b], reduction="none")
        want = want + (ce * noisy[r, a:b]).sum() / t[r, 0] / blk
    assert drawn == set(range(G // blk))
    torch.testing.assert_close(loss, want / B)


def test_suffix_noise_masks_the_block_from_a_cut_on(llada):
    """--suffix-noise 1 (with --block-noise 1): the scored block is masked from a cut point to its end, so no token
    right of a masked one is visible (the answer's end must come from the prompt); cuts cover the whole block;
    clean blocks before, masked blocks after; each row's CE is weighted by 1 / its masked fraction."""
    import torch.nn.functional as F

    from dllm_core.train.mdm import mdm_loss

    model, (B, P, G, blk, pad, mask) = llada, (64, 3, 16, 4, 1, llada.args.mask_token_id)
    x = torch.randint(6, 100, (B, P + G))
    ends = torch.arange(B) % (G + 1)
    x[:, P:] = torch.where(torch.arange(G)[None] < ends[:, None], x[:, P:], pad)
    keep = torch.ones(B, P + G, dtype=torch.bool)
    pos = torch.arange(P + G).expand(B, -1)
    seen, hook = _spy_inputs(model.embed)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(2), True, 0.0, 1.0,
                    blk, pad, suffix_noise=1.0)
    hook.remove()
    noisy = seen[0][:, P:] == mask  # [B, G]
    logits = model(seen[0], pos, keep[:, None, None])
    want, cuts = 0.0, set()
    for r in range(B):
        first = int(noisy[r].int().argmax())  # the cut
        a = first // blk * blk
        assert a <= ends[r] and not noisy[r, :first].any() and noisy[r, first:].all(), (r, noisy[r])
        cuts.add(first - a)
        ce = F.cross_entropy(logits[r, P + first:P + a + blk], x[r, P + first:P + a + blk], reduction="none")
        want = want + ce.sum() / ((a + blk - first) / blk) / blk
    assert cuts == set(range(blk))
    torch.testing.assert_close(loss, want / B)


def test_end_and_creep_noise_mask_the_answers_last_block_up_to_a_cut(llada):
    """--end-noise 1 --creep-noise 1 (with --block-noise 1): every row scores the block holding its answer's last
    token, masked from the block's start to a cut with the rest of the block visible (the vanilla decoder's state
    once it has committed the trailing padding); cuts cover the whole block; clean blocks before, masked blocks
    after; each row's CE is weighted by 1 / its masked fraction."""
    import torch.nn.functional as F

    from dllm_core.train.mdm import mdm_loss

    model, (B, P, G, blk, pad, mask) = llada, (64, 3, 16, 4, 1, llada.args.mask_token_id)
    x = torch.randint(6, 100, (B, P + G))
    ends = torch.arange(B) % G + 1  # answers of 1..G tokens, the last one standing for the EOT
    x[:, P:] = torch.where(torch.arange(G)[None] < ends[:, None], x[:, P:], pad)
    keep = torch.ones(B, P + G, dtype=torch.bool)
    pos = torch.arange(P + G).expand(B, -1)
    seen, hook = _spy_inputs(model.embed)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(3), True, 0.0, 1.0,
                    blk, pad, end_noise=1.0, creep_noise=1.0)
    hook.remove()
    noisy = seen[0][:, P:] == mask  # [B, G]
    logits = model(seen[0], pos, keep[:, None, None])
    want, masked_counts = 0.0, set()
    for r in range(B):
        a = (int(ends[r]) - 1) // blk * blk  # the block of the answer's last token
        last = int(noisy[r, a:a + blk].int().cumsum(0).argmax())  # the last masked token of the block
        assert noisy[r, a] and noisy[r, a:a + last + 1].all() and not noisy[r, a + last + 1:a + blk].any(), noisy[r]
        assert not noisy[r, :a].any() and noisy[r, a + blk:].all()
        masked_counts.add(last + 1)
        ce = F.cross_entropy(logits[r, P + a:P + a + last + 1], x[r, P + a:P + a + last + 1], reduction="none")
        want = want + ce.sum() / ((last + 1) / blk) / blk
    assert masked_counts == set(range(1, blk + 1))
    torch.testing.assert_close(loss, want / B)


def test_suffix_noise_is_validated(tmp_path, capsys):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--suffix-noise", "1.2",
                 "--block-noise", "0.5"]) == 2
    assert "--suffix-noise must be in [0, 1], got 1.2" in capsys.readouterr().err
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--suffix-noise", "0.5"]) == 2
    assert "--suffix-noise shapes the --block-noise rows: it needs --block-noise > 0" in capsys.readouterr().err
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--end-noise", "0.5"]) == 2
    assert "--end-noise shapes the --block-noise rows: it needs --block-noise > 0" in capsys.readouterr().err
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--block-noise", "1",
                 "--suffix-noise", "0.6", "--creep-noise", "0.5"]) == 2
    assert "--suffix-noise + --creep-noise must be <= 1" in capsys.readouterr().err


def test_edit_noise_swaps_visible_tokens_and_scores_them(llada):
    """--edit-noise (LLaDA2.1's token-to-token term): only visible response tokens are swapped, each for a token
    of its own row's response; the loss is the M2T term plus the unweighted CE of every visible response token
    (swapped: restore it; kept: keep it) over the response length."""
    import torch.nn.functional as F

    from dllm_core.train.mdm import mdm_loss, noise_levels

    model, (B, P, G, mask) = llada, (32, 4, 12, llada.args.mask_token_id)
    x = torch.randint(6, 100, (B, P + G))
    keep = torch.ones(B, P + G, dtype=torch.bool)
    pos = torch.arange(P + G).expand(B, -1)
    seen, hook = _spy_inputs(model.embed)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(3), True,
                    edit_noise=0.3)
    hook.remove()
    inp = seen[0]
    assert torch.equal(inp[:, :P], x[:, :P])
    masked, swapped = inp == mask, (inp != mask) & (inp != x)
    assert swapped[:, P:].float().mean() > 0.05 and not swapped[:, :P].any()
    for r, c in swapped.nonzero().tolist():
        assert int(inp[r, c]) in x[r, P:].tolist()
    gen = torch.Generator().manual_seed(3)
    t = noise_levels(B, gen, "cpu")
    logits = model(inp, pos, keep[:, None, None])[:, P:]
    ce = F.cross_entropy(logits.flatten(0, 1), x[:, P:].flatten(), reduction="none").view(B, G)
    want = ((ce * masked[:, P:] / t).sum(1) + (ce * ~masked[:, P:]).sum(1)) / G
    torch.testing.assert_close(loss, want.mean())


def test_edit_noise_is_validated(tmp_path, capsys):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--edit-noise", "1"]) == 2
    assert "--edit-noise must be in [0, 1), got 1.0" in capsys.readouterr().err


def test_block_noise_is_validated(tmp_path, capsys):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--block-noise", "-0.1"]) == 2
    assert "--block-noise must be in [0, 1], got -0.1" in capsys.readouterr().err


def test_prompt_noise_is_validated(tmp_path, capsys):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--prompt-noise", "1.5"]) == 2
    assert "--prompt-noise must be in [0, 1], got 1.5" in capsys.readouterr().err


@pytest.mark.parametrize("kw,msg", [
    (dict(steps=0), "--steps must be >= 1, got 0"),
    (dict(lr=0.0), "--lr must be > 0, got 0.0"),
    (dict(warmup=-1), "--warmup must be >= 0, got -1"),
    (dict(min_lr_ratio=1.5), "--min-lr-ratio must be in [0, 1], got 1.5"),
    (dict(device="tpu"), "--device must be one of ['cpu', 'cuda']"),
    (dict(autocast="float16"), "--autocast must be one of ['none', 'bfloat16'], got 'float16'"),
])
def test_trainer_configs_share_one_validation(kw, msg):
    """Every trainer's config is a ``TrainBase``: the shared fields are checked once, errors name the option;
    the fields a resumed run must match exclude the runtime ones."""
    from dllm_core.drafters.tokenswift.train import TokenSwiftTrainConfig
    from dllm_core.train.config import TrainBase, TrainConfig
    from dllm_core.train.dflash import DFlashTrainConfig
    from dllm_core.train.loop import fingerprint

    for make in (lambda **k: TrainConfig(out="o", **k), lambda **k: DFlashTrainConfig(target="t", out="o", **k),
                 lambda **k: TokenSwiftTrainConfig(target="t", out="o", **k)):
        assert isinstance(make(), TrainBase) and {"lr", "steps", "seed"} <= set(fingerprint(make()))
        assert not set(TrainBase.RUNTIME) & set(fingerprint(make()))
        with pytest.raises(ValueError) as e:
            make(**kw)
        assert msg in str(e.value)


def test_eval_tasks_choose_what_each_evaluation_scores(tmp_path, capsys):
    """--eval-tasks: the evaluation scores those tasks' test variants (curriculum ``min_*`` dropped), not the
    trained ones; a bad spec is an error naming the option."""
    train(tmp_path / "a", "--steps", "2", "--eval-every", "2", "--eval-n", "2",
          "--eval-tasks", "retrieval:min_pairs=2,pairs=4;sort")
    rec = json.loads((tmp_path / "a" / "train_log.jsonl").read_text().splitlines()[0])
    assert set(rec) - {"step", "loss", "step_loss"} == {"retrieval", "sort"}
    assert main(["train-mdm", "--out", str(tmp_path / "b"), *TINY, "--eval-tasks", "nope"]) == 2
    assert "--eval-tasks: " in capsys.readouterr().err


def test_model_size_errors_name_the_cli_option(tmp_path, capsys):
    assert main(["train-mdm", "--out", str(tmp_path), *TINY, "--steps", "2", "--layers", "0"]) == 2
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err


DREAM_TINY = ["--arch", "dream", "--tasks", "arithmetic;sort", "--batch", "3,3", "--dim", "32", "--layers", "2",
              "--heads", "2", "--kv-heads", "1", "--ffn", "64", "--max-len", "256", "--warmup", "2",
              "--save-dtype", "float32"]


def test_mdm_dream_checkpoint_is_a_dream_checkpoint(tmp_path, capsys):
    """--arch dream: a real-layout Dream checkpoint (Qwen2 key names, QKV biases, the task tokenizer's
    special ids) that the loader, transformers' config class and the engine take."""
    from dllm_core import load_model
    from dllm_core.models import DreamModel
    from dllm_core.models.hf_config import DreamConfig

    assert main(["train-mdm", "--out", str(tmp_path), *DREAM_TINY, "--steps", "2"]) == 0
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DreamModel"] and cfg["model_type"] == "Dream"
    assert (cfg["mask_token_id"], cfg["eos_token_id"], cfg["pad_token_id"], cfg["bos_token_id"]) == (5, 1, 1, 0)
    assert DreamConfig(**cfg).num_key_value_heads == 1
    sd = load_file(tmp_path / "model.safetensors")
    assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.mlp.gate_proj.weight", "lm_head.weight"} <= set(sd)
    m = load_model(tmp_path)
    assert isinstance(m, DreamModel) and m.shift_logits and m.args.n_kv_heads == 1
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "Sort: 3 1", "--chat", "--gen-length", "8",
                 "--block-length", "8", "--steps", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nfe"] == 8


def test_dream_init_from_llada_and_arch_is_validated(tmp_path, capsys):
    """--init maps a LLaDA checkpoint into the Dream model (zero QKV biases: the same hidden states);
    --arch is checked and part of a resumable run's identity."""
    from dllm_core import load_model
    from dllm_core.train.common import setup
    from dllm_core.train.config import MDMTrainConfig
    from dllm_core.train.mdm import build

    llada = tmp_path / "llada"
    train(llada, "--steps", "1", "--kv-heads", "1")
    cfg = MDMTrainConfig(out=str(tmp_path / "d"), arch="dream", init=str(llada), tasks="sort", batch="2", dim=32,
                         n_layers=2, n_heads=2, n_kv_heads=1, ffn=64, max_len=256)
    model, hf = build(cfg, setup(cfg)[1])
    src, x = load_model(llada), torch.randint(6, 300, (2, 12))
    pos = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        torch.testing.assert_close(model(x, pos, None), src(x, pos, None))
    assert hf["architectures"] == ["DreamModel"] and hf["mask_token_id"] == src.args.mask_token_id
    assert main(["train-mdm", "--out", str(tmp_path / "e"), *DREAM_TINY, "--steps", "2", "--arch", "bert"]) == 2
    assert "--arch must be one of ['llada', 'dream', 'llada2'], got 'bert'" in capsys.readouterr().err
    assert main(["train-mdm", "--out", str(tmp_path / "f"), *DREAM_TINY, "--steps", "4", "--time-limit", "1e-9"]) == 0
    assert main(["train-mdm", "--out", str(tmp_path / "f"), *DREAM_TINY, "--steps", "4", "--resume",
                 "--arch", "llada"]) == 2
    assert "was written with different settings (arch)" in capsys.readouterr().err


def test_dream_loss_reads_the_shifted_rows_and_learns(dream):
    """Dream's loss for a masked position i is the CE of logit row i - 1 (the engine's reading, the
    first response token from the last prompt row), 1/t-weighted and normalised by G; a few optimizer
    steps on it lower it."""
    import copy

    import torch.nn.functional as F

    from dllm_core.train.mdm import mdm_loss, noise_levels

    model = copy.deepcopy(dream).requires_grad_(True).train()
    B, P, T, mask = 6, 5, 13, model.args.mask_token_id
    x = torch.randint(6, 60, (B, T))
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[:3, :2] = False  # left padding
    pos = (keep.cumsum(-1) - 1).clamp_min(0)
    loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)  # the same draws, in mdm_loss's order
    t = noise_levels(B, gen, "cpu")
    torch.rand(B, 1, generator=gen)
    masked = (torch.rand(B, T, generator=gen) < t) & (torch.arange(T) >= P)
    with torch.no_grad():
        logits = model(x.masked_fill(masked, mask), pos, keep[:, None, None])  # raw rows [B, T, V]
    ce = F.cross_entropy(logits[:, P - 1:T - 1].flatten(0, 1), x[:, P:].flatten(), reduction="none").view(B, -1)
    want = ((ce * masked[:, P:] / t).sum(1) / (T - P)).mean()
    torch.testing.assert_close(loss, want)

    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(12):
        loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(step % 2))
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-2] + losses[-1] < 0.8 * (losses[0] + losses[1]), losses


def test_llada2_block_rows_lie_on_the_grid_and_learn(tmp_path):
    """--arch llada2: block-noise rows mask part of one *grid* block (the prompt's tail block included) and
    every later block; Adam steps on the loss lower it; the routers' loads move the expert bias
    (aux-loss-free balancing); the CLI writes a checkpoint the engine decodes."""
    import copy

    from dllm_core import generate, load_model
    from dllm_core.testing import build_tiny_checkpoint
    from dllm_core.train.mdm import balance_experts, mdm_loss

    base = load_model(build_tiny_checkpoint(tmp_path / "l2", "llada2"))
    model = copy.deepcopy(base).requires_grad_(True).train()
    B, P, G, mask = 16, 5, 24, base.args.mask_token_id
    x = torch.randint(6, 100, (B, P + G))
    x[:, P + 12:] = 1  # 12-token answers, then padding (pad id 1)
    keep = torch.ones(B, P + G, dtype=torch.bool)
    pos = torch.arange(P + G).expand(B, -1)
    seen, hook = _spy_inputs(model.embed)
    mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(0), True, 0.0, 1.0, 4, 1)
    hook.remove()
    firsts = set()
    for row in (seen[0] == mask):  # grid blocks of 8 (the checkpoint's block_size), not the --block-noise arg
        assert any(row[(k + 1) * 8:].all() and not row[:max(k * 8, P)].any() for k in range(3)), row
        firsts.add(int(row.nonzero()[0]) // 8)
    assert {0, 1, 2} <= firsts  # the prompt's tail block (positions 5-7) is drawn too

    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for step in range(12):
        loss = mdm_loss(model, x, keep[:, None, None], pos, P, mask, torch.Generator().manual_seed(step % 2),
                        True, 0.0, 1.0, 8, 1)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-2] + losses[-1] < 0.8 * (losses[0] + losses[1]), losses
    moe = model.layers[1].mlp
    bias, load = moe.expert_bias.detach().clone(), moe.load.clone()
    balance_experts(model, 0.5)
    torch.testing.assert_close(moe.expert_bias.detach(), bias + 0.5 * torch.sign(load.mean() - load))

    out = tmp_path / "trained"
    assert main(["train-mdm", "--arch", "llada2", "--out", str(out), *TINY[:2], "--dim", "32", "--layers", "2",
                 "--heads", "2", "--ffn", "64", "--moe-ffn", "16", "--experts", "4", "--top-k", "2", "--steps", "3",
                 "--block-noise", "1", "--save-dtype", "float32", "--tasks", "arithmetic;sort;retrieval:pairs=6"]) == 0
    trained = load_model(out)
    assert trained.block_causal == 8 and generate(trained, [[0, 9, 12]], gen_length=8, block_length=8, steps=8).tokens.shape == (1, 8)
