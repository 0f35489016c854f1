"""Multi-token self-drafting heads (TokenSwift section 1): gamma chained residual linear layers.

From the target's last (final-norm) hidden state h0 at position p: h_i = f_i(h_{i-1}) + h_{i-1} and
l_i = g(h_i), with g the target's own frozen LM head; l_0 predicts position p+1 (it *is* the target's
next-token logit when h0 comes from the full-cache forward) and l_i position p+1+i. Only the f_i are
trained; they start at zero, so every head initially repeats the LM head's prediction.

Checkpoint: ``config.json`` ({"architectures": ["TokenSwiftHeads"], "model_type": "tokenswift_heads",
hidden_size, vocab_size, num_heads}; ``model_type`` lets a host's ``AutoConfig`` read it)
+ ``model.safetensors`` (``layers.{i}.weight`` [H, H], ``layers.{i}.bias`` [H]).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

ARCHITECTURE = "TokenSwiftHeads"
MODEL_TYPE = "tokenswift_heads"  # dllm_core.models.hf_config.TokenSwiftHeadsConfig
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class HeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 3  # gamma

    def __post_init__(self):
        for n in ("hidden_size", "vocab_size", "num_heads"):
            if getattr(self, n) < 1:
                raise ValueError(f"tokenswift heads: {n} must be >= 1, got {getattr(self, n)}")

    @classmethod
    def for_target(cls, target_config, num_heads: int = 3) -> "HeadsConfig":
        return cls(target_config.hidden_size, target_config.vocab_size, num_heads)


class TokenSwiftHeads(nn.Module):
    """gamma residual linear layers on the target's last hidden state; logits through the target's LM head."""

    def __init__(self, cfg: HeadsConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_heads))
        for f in self.layers:
            nn.init.zeros_(f.weight)
            nn.init.zeros_(f.bias)

    def forward(self, h0: torch.Tensor) -> torch.Tensor:
        """h0 [..., H] -> [..., gamma + 1, H] = (h0, h1, ..., h_gamma), chained residually."""
        hs = [h0]
        for f in self.layers:
            hs.append(f(hs[-1]) + hs[-1])
        return torch.stack(hs, -2)

    def logits(self, h0: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """h0 [..., H] -> logits [..., gamma + 1, V]: l_0 (the LM head itself) .. l_gamma."""
        return lm_head(self(h0))


def save_heads(heads: TokenSwiftHeads, out_dir: str | Path) -> Path:
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **asdict(heads.cfg)}
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in heads.state_dict().items()}
    save_file(state, str(d / WEIGHTS), metadata={"format": "pt"})
    return d


def load_heads(heads_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> TokenSwiftHeads:
    """Load a heads checkpoint written by ``save_heads`` (frozen, eval mode)."""
    from safetensors.torch import load_file

    d = Path(heads_dir)
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--heads: {d} has no config.json")
    raw = json.loads(path.read_text())
    if raw.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"--heads: {path} is not a {ARCHITECTURE} checkpoint (architectures "
                         f"{raw.get('architectures')})")
    cfg = HeadsConfig(**{k: raw[k] for k in ("hidden_size", "vocab_size", "num_heads")})
    if not (d / WEIGHTS).is_file():
        raise FileNotFoundError(f"--heads: {d} has no {WEIGHTS}")
    heads = TokenSwiftHeads(cfg)
    heads.load_state_dict(load_file(str(d / WEIGHTS), device=str(device)))
    return heads.to(device=device, dtype=dtype).eval().requires_grad_(False)


def check_compatible(heads: TokenSwiftHeads, target) -> None:
    """The heads must match the target's hidden size and vocabulary (they use its LM head)."""
    c = target.config
    if (heads.cfg.hidden_size, heads.cfg.vocab_size) != (c.hidden_size, c.vocab_size):
        raise ValueError(f"--heads: heads for hidden {heads.cfg.hidden_size} / vocab {heads.cfg.vocab_size} do not "
                         f"fit the target (hidden {c.hidden_size} / vocab {c.vocab_size})")
