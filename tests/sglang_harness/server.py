"""TEST-ONLY: launch SGLang's real HTTP server on a CPU with this harness and talk to it.

    with SGLangServer("models/qwen3-tasks", "--dtype", "float32") as srv:
        srv.generate([1, 2, 3], max_new_tokens=8)["output_ids"]

Every process of the server imports ``sitecustomize`` from this directory (``PYTHONPATH``). The launch
adds the CPU flags (``--device cpu --attention-backend torch_native``, a small KV pool, ``--sleep-on-idle``)
to the given ones.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

HARNESS = Path(__file__).resolve().parent
ROOT = HARNESS.parents[1]
if str(HARNESS.parent) not in sys.path:  # tests/health.py (the bench scripts put only this directory on the path)
    sys.path.append(str(HARNESS.parent))
from health import DEADLINE_S, ServerExited, ServerNotHealthy, read_log, wait_healthy  # noqa: E402
# --sleep-on-idle: an idle scheduler waits on its sockets instead of polling a CPU core (2-core CI machine)
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "16384",
             "--sleep-on-idle")


def harness_env(threads: int = 1) -> dict:
    """The server's environment: this harness first on PYTHONPATH, the repo importable, offline."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), SGLANG_USE_CPU_ENGINE="1")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(model: str | Path, *flags: str, port: int) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *CPU_FLAGS,
            "--host", "127.0.0.1", "--port", str(port), *flags]


class SGLangServer:
    """One real SGLang server process (its own process group), started on enter, killed on exit. A launch that
    is not healthy within ``startup_s`` is stopped and raises ``ServerNotHealthy`` (process list, log tail)."""

    def __init__(self, model: str | Path, *flags: str, log: Path | None = None, startup_s: float = DEADLINE_S):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"sglang-{self.port}.log"
        self.command = launch_command(model, *flags, port=self.port)
        self.startup_s = startup_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "SGLangServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, tries: int = 3) -> None:
        """Launch and wait until healthy; a port taken meanwhile (the server's own internal ports are picked after
        ours) is retried on a fresh one."""
        for _ in range(tries - 1):
            if self._start():
                return
            self.stop()
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self.command[self.command.index("--port") + 1] = str(self.port)
        if not self._start():
            raise ServerExited("SGLang server", -1, self.log())

    def _start(self) -> bool:
        """False: the HTTP port was taken before the server bound it."""
        taken = f"('127.0.0.1', {self.port}): address already in use"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=harness_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return wait_healthy(self.proc, self.url, self.log_path, "SGLang server", self.startup_s,
                                gave_up=lambda: taken in self.log())
        except ServerNotHealthy:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        return read_log(self.log_path)

    def get(self, path: str) -> tuple[int, dict | str]:
        return self._call(urllib.request.Request(self.url + path))

    def post(self, path: str, body: dict) -> tuple[int, dict | str]:
        """(HTTP status, JSON body or text); error statuses are returned, not raised."""
        data = json.dumps(body).encode()
        return self._call(urllib.request.Request(self.url + path, data, {"content-type": "application/json"}))

    def generate(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        """POST /generate (greedy unless ``sampling`` says otherwise); raises on a non-200 answer."""
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        status, body = self.post("/generate", {"input_ids": input_ids, "sampling_params": params})
        if status != 200:
            raise RuntimeError(f"/generate answered {status}: {body}")
        return body

    @staticmethod
    def _call(request, timeout: float = 600) -> tuple[int, dict | str]:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                status, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, raw = e.code, e.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")
