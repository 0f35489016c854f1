"""``DllmLM``: lm-evaluation-harness's ``LM`` interface over this package's checkpoints, registered as
``--model dllm`` (``register()`` in ``__init__.py``, or the ``lm_eval.models`` entry point).

- ``generate_until``: requests grouped by their generation kwargs, decoded in batches of ``batch_size`` in
  request order; each text is cut at the first EOS / EOT id (as ``dllm eval``), then at the earliest ``until``
  string. Contexts are tokenized as they come (no special tokens added): with ``--apply_chat_template`` the
  harness renders the tokenizer's chat template (``apply_chat_template``), the prompt ``dllm eval`` builds.
- ``loglikelihood``: LLaDA's Monte-Carlo estimate for LLaDA / Dream, exact for AR targets, an error for LLaDA2
  (``likelihood.py``). The pair is tokenized as the model was trained on (prompt ids, then the answer's;
  ``encode_pair``). lm-eval's HF model and LLaDA's harness move the context's trailing whitespace into the
  continuation, which with a chat template moves the generation prompt's closing newlines into the scored part:
  tokens the model never learnt to predict (measured on the first 32 dllm_arithmetic_mc docs, mc_num 32: the
  right choice first 28 / 32 with LLaDA, 26 / 32 with Dream that way; 32 / 32 and 28 / 32 this way).
- ``loglikelihood_rolling``: not provided (see its error).
"""
from __future__ import annotations

import json

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from .backends import load_backend
from .config import HarnessConfig

LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm-eval's EvaluatorConfig.device default, passed even when --device is not
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def engine_overrides(gen_kwargs: dict) -> dict:
    """A request's sampling options for the engine (``do_sample`` false or absent: greedy); ``max_gen_toks`` is
    not read (the response canvas is the model arg ``gen_length``); unknown keys are an error."""
    unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
    if unknown:
        raise ValueError(f"generation_kwargs: unsupported key(s) {unknown}; allowed: {list(GEN_KWARGS)}")
    if not gen_kwargs.get("do_sample", False):
        return {}
    out = {"temperature": float(gen_kwargs.get("temperature", 1.0))}
    out.update({k: gen_kwargs[k] for k in ("top_p", "top_k") if gen_kwargs.get(k) is not None})
    return out


def cut_at(text: str, until) -> str:
    """``text`` before the earliest occurrence of any ``until`` string (a string or a list of them)."""
    stops = [until] if isinstance(until, str) else list(until or [])
    return text[:min([i for s in stops if s and (i := text.find(s)) >= 0], default=len(text))]


def group_by_kwargs(requests) -> list[list[int]]:
    """Indices of ``generate_until`` requests grouped by identical generation kwargs, each group in request order."""
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(json.dumps(r.args[1], sort_keys=True, default=str), []).append(i)
    return list(groups.values())


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context / continuation ids as the model was trained on them (``dllm eval``'s prompt ids, then the
    answer's): the continuation is the tail of the whole pair's ids when the context's own ids are their head,
    else its own ids. The context keeps its trailing whitespace (a chat template's generation prompt ends in
    it): unlike lm-eval's HF model, which moves it to the continuation (module docstring)."""
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    if whole[:len(ctx)] == ctx:
        return ctx, whole[len(ctx):]
    return ctx, tok(continuation, add_special_tokens=False)["input_ids"]


@register_model("dllm")
class DllmLM(LM):
    """LLaDA / Dream / LLaDA2 through the embedded engine, Qwen3 AR targets greedily or with DFlash / TokenSwift
    speculation. Keyword arguments: ``HarnessConfig``'s fields (lm-eval's ``--model_args``)."""

    def __init__(self, **model_args):
        super().__init__()
        self.cfg = HarnessConfig.from_model_args(model_args)
        if self.cfg.threads is not None:
            torch.set_num_threads(self.cfg.threads)
        self.backend = load_backend(self.cfg)
        self._device = torch.device(self.cfg.device)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DllmLM:
        """``--model_args`` win over the harness's own ``--batch_size`` / ``--device``. Its CLI always passes both
        (defaults 1 and ``cuda:0``); its default ``cuda:0`` on a machine without it is dropped (this model's
        default, ``cpu``, applies), as lm-eval's HF model does, while any other unavailable device is an error."""
        from ..models import available_devices

        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        if extra.get("device") == LM_EVAL_DEFAULT_DEVICE and LM_EVAL_DEFAULT_DEVICE not in available_devices():
            del extra["device"]
        return cls(**{**extra, **arg_dict})

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DllmLM:
        """As ``create_from_arg_obj`` from ``key=value,...`` (a spec with commas needs the dict form)."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tok(self):
        return self.backend.tok

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Texts for ``(context, gen_kwargs)`` requests (module docstring)."""
        out: list[str | None] = [None] * len(requests)
        with tqdm(total=len(requests), disable=disable_tqdm, desc="dllm generate_until") as bar:
            for idx in group_by_kwargs(requests):
                for s in range(0, len(idx), self.cfg.batch_size):
                    chunk = idx[s:s + self.cfg.batch_size]
                    for i, text in zip(chunk, self._generate([requests[i] for i in chunk])):
                        out[i] = text
                    bar.update(len(chunk))
        return out

    def _generate(self, batch) -> list[str]:
        """One engine batch of requests sharing their generation kwargs, cut at ``until``."""
        kw = batch[0].args[1]
        prompts = [self.tok(r.args[0], add_special_tokens=False)["input_ids"] for r in batch]
        texts = [cut_at(t, kw.get("until")) for t in self.backend.generate(prompts, engine_overrides(kw))]
        for r, t in zip(batch, texts):
            self.cache_hook.add_partial("generate_until", r.args, t)
        return texts

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each ``(context, continuation)`` request (module docstring)."""
        out = []
        for r in tqdm(requests, disable=disable_tqdm, desc="dllm loglikelihood"):
            ctx, cont = encode_pair(self.tok, *r.args)
            if not ctx:  # an empty context is conditioned on the start-of-text token
                ctx = [self.tok.bos_token_id if self.tok.bos_token_id is not None else self.tok.eos_token_id]
            res = self.backend.loglikelihood(ctx, cont)
            self.cache_hook.add_partial("loglikelihood", r.args, res)
            out.append(res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(
            "loglikelihood_rolling (perplexity tasks) is not provided by --model dllm: a masked-diffusion model has "
            "no left-to-right factorisation to roll over a long text, only a Monte-Carlo bound of a continuation's "
            "likelihood given a context (loglikelihood); for an AR target use --model hf")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template rendered as text (tokenizing it gives ``encode_prompt(chat=True)``'s ids)."""
        if not self.tok.chat_template:
            raise ValueError(f"--apply_chat_template: the tokenizer_config.json of {self.cfg.pretrained} has no "
                             f"chat_template")
        return self.tok.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    @property
    def tokenizer_name(self) -> str:
        return str(self.cfg.pretrained).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tok.chat_template

    def get_model_info(self) -> dict:
        """The model args, recorded in lm-eval's results ``config``."""
        return self.cfg.model_info()
