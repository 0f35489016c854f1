"""TEST-ONLY: a server run as a job. A fixture launches the server, sends every request its tests need through
``Recorded.run``, stops the server, and hands the record to the tests, which assert on it: no server stays alive
idle between tests. A part that raised is re-raised by the test that reads it (the others still pass)."""
from __future__ import annotations


class Recorded:
    """Named results of calls made while a server was up."""

    def __init__(self):
        self._out: dict[str, tuple[bool, object]] = {}

    def run(self, name: str, fn, *args, **kwargs) -> None:
        try:
            self._out[name] = (True, fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - kept for the test that reads this part
            self._out[name] = (False, e)

    def __getitem__(self, name: str):
        ok, value = self._out[name]
        if not ok:
            raise value
        return value
