"""Training run configs, validated once in ``__post_init__``: ``TrainBase`` holds what every trainer shares
(optimisation, seed, device, checkpoint cadence; ``train/loop.py`` reads these), ``TrainConfig`` is the task
models' (``dllm train-mdm`` / ``train-ar``); the drafter trainers extend ``TrainBase`` beside their code."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..tasks import parse_tasks

DEVICES = ("cpu", "cuda")
AUTOCAST = ("none", "bfloat16")
T_SAMPLING = ("iid", "stratified")
MDM_ARCHS = ("llada", "dream", "llada2")


@dataclass(frozen=True, kw_only=True)
class TrainBase:
    """The fields ``train/loop.py`` runs on. Subclasses redeclare a field to change its default; errors name
    the CLI option of the field."""

    RUNTIME: ClassVar[tuple[str, ...]] = ("resume", "save_every", "eval_every", "device", "out",
                                          "time_limit", "autocast")  # not part of a resumable run's identity
    FLAGS: ClassVar[dict[str, str]] = {}  # CLI options not spelled --field-name
    out: str
    steps: int = 2000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    device: str = "cpu"
    save_every: int = 200
    eval_every: int = 0
    resume: bool = False
    time_limit: float = 0.0  # seconds; stop early (saving everything, --resume continues) once exceeded, 0 = none
    autocast: str = "none"  # "bfloat16": losses under torch.autocast (fp32 weights and optimizer, bf16 matmuls)

    def __post_init__(self):
        self.check_at_least(1, "steps", "save_every")
        self.check_at_least(0, "warmup", "eval_every", "time_limit", "weight_decay")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.clip > 0:
            raise ValueError(f"--clip must be > 0, got {self.clip}")
        if self.autocast not in AUTOCAST:
            raise ValueError(f"--autocast must be one of {list(AUTOCAST)}, got {self.autocast!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"--device must be one of {list(DEVICES)}, got {self.device!r}")

    def check_at_least(self, low: int, *names: str) -> None:
        """Each named field must be >= ``low`` (the error names its CLI option)."""
        for n in names:
            if getattr(self, n) < low:
                flag = self.FLAGS.get(n, "--" + n.replace("_", "-"))
                raise ValueError(f"{flag} must be >= {low}, got {getattr(self, n)}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig(TrainBase):
    """Model sizes, optimisation and the task mixture. ``tasks`` is a ``;``-separated list of task
    specs and ``batch`` the number of examples of each task in every optimizer step (one int per task)."""

    RUNTIME: ClassVar[tuple[str, ...]] = TrainBase.RUNTIME + ("eval_n", "eval_tasks")
    FLAGS: ClassVar[dict[str, str]] = {"n_layers": "--layers", "n_heads": "--heads"}
    tasks: str = "arithmetic;sort;retrieval:min_pairs=4"
    batch: str = "32,16,2"
    dim: int = 192
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int | None = None
    ffn: int = 512
    max_len: int = 4096
    vocab_size: int = 512
    eval_n: int = 32
    eval_tasks: str | None = None  # ';'-separated specs evaluated every --eval-every steps (None: the trained tasks)
    save_dtype: str = "bfloat16"
    init: str | None = None  # start from this checkpoint's weights (same sizes) instead of a random init
    t_sampling: str = "stratified"  # MDM noise levels of a batch: "iid" or "stratified" (low-discrepancy)
    prompt_noise: float = 0.0  # MDM: fraction of rows noised whole (prompt too; LLaDA's pre-training loss)
    block_noise: float = 0.0  # MDM: fraction of rows noised block-wise as the semi-AR decoder sees them
    suffix_noise: float = 0.0  # MDM: fraction of block-noise rows masked from a cut point to the block's end
    end_noise: float = 0.0  # MDM: fraction of block-noise rows whose block is the one holding the answer's end
    creep_noise: float = 0.0  # MDM: fraction of block-noise rows masked from the block's start to a cut point
    edit_noise: float = 0.0  # MDM: fraction of visible response tokens swapped for the token-to-token (editing) term

    def __post_init__(self):
        tasks = parse_tasks(self.tasks)
        sizes = self.batch_sizes
        if len(sizes) != len(tasks) or any(b < 1 for b in sizes):
            raise ValueError(f"--batch needs one positive int per task ({len(tasks)}), got {self.batch!r}")
        super().__post_init__()
        self.check_at_least(1, "dim", "n_layers", "n_heads", "ffn", "max_len", "vocab_size")
        self.check_at_least(0, "eval_n")
        if self.eval_tasks is not None:
            self.eval_task_list()
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 2:
            raise ValueError(f"--dim {self.dim} must be divisible by --heads {self.n_heads} into an even head "
                             f"size (RoPE)")
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"--kv-heads must divide --heads {self.n_heads}, got {self.n_kv_heads}")
        if self.t_sampling not in T_SAMPLING:
            raise ValueError(f"--t-sampling must be one of {list(T_SAMPLING)}, got {self.t_sampling!r}")
        if not 0 <= self.prompt_noise <= 1:
            raise ValueError(f"--prompt-noise must be in [0, 1], got {self.prompt_noise}")
        if not 0 <= self.block_noise <= 1:
            raise ValueError(f"--block-noise must be in [0, 1], got {self.block_noise}")
        for name in ("suffix_noise", "end_noise", "creep_noise"):
            flag, v = "--" + name.replace("_", "-"), getattr(self, name)
            if not 0 <= v <= 1:
                raise ValueError(f"{flag} must be in [0, 1], got {v}")
            if v > 0 and self.block_noise == 0:
                raise ValueError(f"{flag} shapes the --block-noise rows: it needs --block-noise > 0")
        if self.suffix_noise + self.creep_noise > 1:
            raise ValueError(f"--suffix-noise + --creep-noise must be <= 1 (disjoint fractions of the block rows), "
                             f"got {self.suffix_noise} + {self.creep_noise}")
        if not 0 <= self.edit_noise < 1:
            raise ValueError(f"--edit-noise must be in [0, 1), got {self.edit_noise}")
        if self.save_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--save-dtype must be one of ['bfloat16', 'float32'], got {self.save_dtype!r}")

    @property
    def batch_sizes(self) -> list[int]:
        try:
            return [int(b) for b in self.batch.split(",")]
        except ValueError:
            raise ValueError(f"--batch must be comma-separated ints, got {self.batch!r}") from None

    def task_list(self):
        return parse_tasks(self.tasks)

    def eval_task_list(self):
        """``--eval-tasks`` (errors name that option); None when the trained tasks are evaluated."""
        return None if self.eval_tasks is None else parse_tasks(self.eval_tasks, "--eval-tasks")


@dataclass(frozen=True, kw_only=True)
class MDMTrainConfig(TrainConfig):
    """``dllm train-mdm``: the task-model config plus the architecture trained (``arch``: ``llada`` =
    ``LLaDAModelLM``, unshifted logits; ``dream`` = ``DreamModel``, QKV biases and logits shifted by one)."""

    arch: str = "llada"
    experts: int = 8        # llada2: routed experts per MoE layer (+ one shared expert)
    top_k: int = 2          # llada2: experts per token
    moe_ffn: int = 128      # llada2: each expert's hidden size
    block_size: int = 8     # llada2: the block-causal attention's block (the tasks' block_length)
    balance: float = 1e-3   # llada2: expert-bias step of the aux-loss-free load balancing (0: off)

    def __post_init__(self):
        super().__post_init__()
        if self.arch not in MDM_ARCHS:
            raise ValueError(f"--arch must be one of {list(MDM_ARCHS)}, got {self.arch!r}")
        self.check_at_least(1, "experts", "top_k", "moe_ffn", "block_size")
        if self.top_k > self.experts:
            raise ValueError(f"--top-k {self.top_k} must be <= --experts {self.experts}")
        if self.balance < 0:
            raise ValueError(f"--balance must be >= 0, got {self.balance}")
