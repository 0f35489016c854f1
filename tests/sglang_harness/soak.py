"""TEST-ONLY: a soak of a running SGLang server (loopback): many concurrent requests of mixed prompts and
options, some clients hanging up mid-request, bad requests of many kinds among them.

    report = soak(url, cases, bad, n=240, in_flight=24, hang_up=0.2, seed=0)

``cases``: distinct good requests (``/generate`` bodies); each is sent many times and must get the same answer
every time it is not hung up on (greedy decoding is deterministic). ``bad``: ``{name: (body bytes, expected
text)}``, each sent several times among the good ones, each must get a 4xx whose body names the problem.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass
class SoakReport:
    answers: dict[int, set] = field(default_factory=dict)  # good case -> the distinct answers it got
    served: int = 0  # good requests answered 200
    lost: list = field(default_factory=list)  # good requests not answered 200: (case, status, body)
    hung_up: int = 0
    bad: dict[str, list] = field(default_factory=dict)  # bad kind -> [(status, body)]
    seconds: float = 0.0


def post(url: str, data: bytes, timeout: float = 300) -> tuple[int, str]:
    """(status, body text); error statuses returned, not raised."""
    req = urllib.request.Request(url + "/generate", data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def hang_up(url: str, data: bytes, after_s: float) -> None:
    """Send the request, then close the connection without reading the answer."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (u.netloc.encode(), len(data)) + data)
        time.sleep(after_s)


def answer(body: str) -> tuple:
    return tuple(json.loads(body)["output_ids"])


def soak(url: str, cases: list[dict], bad: dict[str, tuple[bytes, str]], n: int = 240, in_flight: int = 24,
         hang_up_share: float = 0.2, bad_each: int = 3, seed: int = 0) -> SoakReport:
    """Run the soak (module doc); -> what each kind of request got."""
    rng = random.Random(seed)
    jobs = [("good", rng.randrange(len(cases))) for _ in range(n)]
    jobs = [("hang", c) if rng.random() < hang_up_share else (k, c) for k, c in jobs]
    jobs += [("bad", name) for name in bad for _ in range(bad_each)]
    rng.shuffle(jobs)
    rep = SoakReport(bad={name: [] for name in bad})

    def run(job):
        kind, what = job
        if kind == "hang":
            hang_up(url, json.dumps(cases[what]).encode(), rng.uniform(0.0, 0.3))
            return job, None
        if kind == "bad":
            return job, post(url, bad[what][0])
        return job, post(url, json.dumps(cases[what]).encode())

    t = time.perf_counter()
    with cf.ThreadPoolExecutor(in_flight) as pool:
        for (kind, what), got in pool.map(run, jobs):
            if kind == "hang":
                rep.hung_up += 1
            elif kind == "bad":
                rep.bad[what].append(got)
            elif got[0] == 200:
                rep.served += 1
                rep.answers.setdefault(what, set()).add(answer(got[1]))
            else:
                rep.lost.append((what, *got))
    rep.seconds = time.perf_counter() - t
    return rep


def bad_requests(good_ids: list[int], vocab: int, context: int, mask_id: int | None = None,
                 dllm: bool = False) -> dict[str, tuple[bytes, str]]:
    """Bad ``/generate`` requests of many kinds: {name: (body, text the 4xx body must hold)}; ``dllm``: also
    what a diffusion decode does not do (and the mask token in the prompt, ``mask_id``)."""
    def body(ids=good_ids, extra=None, **sp) -> bytes:
        return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8, **sp}, **(extra or {})}).encode()

    out = {
        "token id past the vocabulary": (body(good_ids[:2] + [vocab + 7] + good_ids[2:]), "vocabulary"),
        "negative token id": (body(good_ids[:2] + [-3] + good_ids[2:]), "vocabulary"),
        "negative max_new_tokens": (body(max_new_tokens=-5), "max_new_tokens"),
        "unknown sampling field": (body(colour="blue"), "colour"),
        "malformed JSON": (b'{"input_ids": [1, 2', "JSON"),
        "empty prompt": (body([]), "empty"),
        "prompt past the context": (body(good_ids * (context // len(good_ids) + 1)), "context length"),
        "negative temperature": (body(temperature=-1), "temperature"),
        "top_p above 1": (body(top_p=2), "top_p"),
    }
    if dllm:
        out |= {
            "mask token in the prompt": (body(good_ids[:2] + [mask_id] + good_ids[2:]), "mask"),
            "max_new_tokens 0": (body(max_new_tokens=0), "max_new_tokens"),  # an AR server prefills only
            "empty text prompt": (json.dumps({"text": "", "sampling_params": {"max_new_tokens": 8}}).encode(),
                                  "empty prompt"),
            "n > 1": (body(n=2), "sampling_params.n"),
            "prompt logprobs": (body(extra={"return_logprob": True, "logprob_start_len": 0}), "logprob_start_len"),
            "regex": (body(regex="[0-9]+"), "sampling_params.regex"),
            "json schema": (body(json_schema='{"type": "string"}'), "sampling_params.json_schema"),
            "min_new_tokens": (body(min_new_tokens=4), "sampling_params.min_new_tokens"),
            "repetition penalty": (body(repetition_penalty=1.3), "sampling_params.repetition_penalty"),
        }
    return out
