"""Progress bars that stay readable in logs: tqdm's live bar on a terminal; elsewhere (CI, ``| tee``, a file)
one plain line at most every ``every_s`` seconds and a last one at the end, instead of carriage-return redraws."""
from __future__ import annotations

import sys

from tqdm import tqdm


class _Lines:
    """A stream for tqdm that turns each redraw (``\\r`` + status) into one line; blank redraws are dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        for part in text.split("\r"):
            line = part.rstrip("\n")
            if line.strip():
                self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):
    """Status changes wait for the next timed line instead of forcing one."""

    def set_postfix(self, ordered_dict=None, refresh=False, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s="", refresh=False):
        super().set_postfix_str(s, refresh=False)


def progress(iterable=None, *, total: int | None = None, desc: str = "", initial: int = 0, disable: bool = False,
             every_s: float = 30.0, file=None):
    """``tqdm(iterable, total=..., desc=...)`` with the terminal check above (``file``: default stderr)."""
    stream = file or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return tqdm(iterable, total=total, desc=desc, initial=initial, disable=disable, file=stream,
                    dynamic_ncols=True)
    return _LogBar(iterable, total=total, desc=desc, initial=initial, disable=disable, file=_Lines(stream),
                   mininterval=every_s, maxinterval=every_s, ncols=120, ascii=True)
