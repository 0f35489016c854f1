"""Tokenizer loading (local ``tokenizer.json`` + ``tokenizer_config.json``) and prompt encoding."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir: str | Path):
    """HF fast tokenizer from a local directory; never touches the network."""
    from transformers import PreTrainedTokenizerFast

    d = Path(model_dir)
    if not (d / "tokenizer.json").is_file():
        raise FileNotFoundError(f"--model: {d} has no tokenizer.json")
    return PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)


def encode_prompt(tok, text: str, chat: bool, turns: tuple[tuple[str, str], ...] = ()) -> list[int]:
    """Token ids of ``text``; with ``chat`` the tokenizer's chat template wraps it as a user turn, after ``turns``
    (earlier (user, assistant) pairs: a multi-turn few-shot prompt)."""
    if not chat:
        if turns:
            raise ValueError("a multi-turn prompt (shot_format=turns) needs the chat template")
        return tok(text, add_special_tokens=False)["input_ids"]
    if not tok.chat_template:
        raise ValueError("--chat: the tokenizer_config.json of this model has no chat_template")
    msgs = [{"role": r, "content": c} for u, a in turns for r, c in (("user", u), ("assistant", a))]
    ids = tok.apply_chat_template(msgs + [{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def special_id(tok, token: str) -> int | None:
    """Id of a special token string, or None when the vocabulary lacks it."""
    i = tok.convert_tokens_to_ids(token)
    return None if i is None or i == tok.unk_token_id else i
