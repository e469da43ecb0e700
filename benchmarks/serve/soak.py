"""Does the server stay up, drain and keep its memory flat under hours of mixed and hostile traffic?

Starts ``kiln serve`` in a child process (the embedded SmolLM2 on the CPU by default, ``--model``
to change it) and, for ``--minutes``, keeps ``--concurrency`` clients busy with a mix of:

- completions and chat completions, streamed and not, ``n`` up to 3, seeded sampling and greedy;
- streams the client closes after a few chunks (cancellations);
- bad inputs: out-of-range seeds and penalties, lone surrogates, unknown fields, wrong types,
  malformed JSON, a wrong model name;
- oversized requests: more prompts x n than the server allows, bodies past ``max_request_bytes``.

Every ``--sample-s`` it scrapes ``/metrics`` and reads the server's resident memory (``/proc``).
At the end it waits for the engine to drain and checks: no 5xx other than ones the mix provoked
on purpose (none are), ``/health`` 200, zero running requests and zero KV blocks in use, and
resident memory over the last ``--flat-minutes`` within ``--flat-pct`` percent (max over min).
Writes ``soak-<model>.json`` (every sample, the status counts, the checks) and the server's log
``soak-<model>.log`` under ``--out``; exits 1 when a check fails.

    python -m benchmarks.serve soak --minutes 20
    python -m benchmarks.serve soak --minutes 2 --flat-minutes 1 --model random:tiny
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.common import out_dir



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--sample-s", type=float, default=30.0)
    p.add_argument("--flat-minutes", type=float, default=15.0)
    p.add_argument("--flat-pct", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(out_dir()))
    return p.parse_args(argv)


# ---- the traffic ---------------------------------------------------------------------------------
WORDS = "the river city light music garden window paper story market house world water year people".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _good(rng: random.Random, model: str) -> tuple[str, dict, bool]:
    stream = rng.random() < 0.5
    sampling = {"temperature": 0.0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(2**31)}
    body = {"model": model, "max_tokens": rng.randint(1, 48), "stream": stream, "n": rng.choice((1, 1, 2, 3)),
            **sampling}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": _text(rng, rng.randint(1, 200))}, stream
    messages = [{"role": "user", "content": _text(rng, rng.randint(1, 60))}]
    return "/v1/chat/completions", {**body, "messages": messages}, stream


def _bad(rng: random.Random, model: str) -> tuple[str, object]:
    base = {"model": model, "prompt": "hello", "max_tokens": 4}
    cases = [
        {**base, "seed": 2**64}, {**base, "seed": 2**63}, {**base, "presence_penalty": 1e9},
        {**base, "prompt": "abc\ud800"}, {**base, "tools": [{"type": "function"}]}, {**base, "max_tokens": "x"},
        {**base, "model": "no-such-model"}, {**base, "prompt": [[-5, 2**40]]}, {**base, "n": 10**6},
        {**base, "prompt": ["hi"] * 1000, "n": 64}, {"model": model, "messages": [{"role": "user", "content": 7}]},
        "{not json", {**base, "prompt": "x" * (2 << 20)},
    ]
    return "/v1/completions" if rng.random() < 0.8 else "/v1/chat/completions", rng.choice(cases)


class Tally:
    def __init__(self):
        self.lock = threading.Lock()
        self.status: dict[str, int] = {}
        self.errors: list[str] = []  # 5xx answers and transport failures
        self.accepted: list[str] = []  # bad inputs the server took
        self.cancelled = 0

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.accepted) < 50:
                self.accepted.append(text)

    def add(self, kind: str, code, detail: str = "") -> None:
        with self.lock:
            key = f"{kind}:{code}"
            self.status[key] = self.status.get(key, 0) + 1
            if isinstance(code, int) and code >= 500 or code == "exception":
                if len(self.errors) < 50:
                    self.errors.append(f"{key} {detail[:300]}")


def client_loop(url: str, model: str, stop_at: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as http:
        while time.monotonic() < stop_at:
            roll = rng.random()
            try:
                if roll < 0.25:
                    path, body = _bad(rng, model)
                    # json.dumps escapes a lone surrogate as \ud800, as a hostile client would send it.
                    content = body if isinstance(body, str) else json.dumps(body)
                    r = http.post(path, headers={"Content-Type": "application/json"}, content=content)
                    tally.add("bad", r.status_code, r.text)
                    if r.status_code < 400:
                        tally.add("bad-accepted", r.status_code)
                        tally.note(f"accepted: {content[:200]}")
                    continue
                path, body, stream = _good(rng, model)
                if not stream:
                    r = http.post(path, json=body)
                    tally.add("good", r.status_code, r.text)
                    continue
                cancel_after = rng.randint(1, 4) if rng.random() < 0.3 else None
                with http.stream("POST", path, json=body) as r:
                    chunks = 0
                    for line in r.iter_lines():
                        chunks += line.startswith("data:")
                        if cancel_after is not None and chunks >= cancel_after:
                            break
                    tally.add("stream", r.status_code)
                    if cancel_after is not None and chunks >= cancel_after:
                        with tally.lock:
                            tally.cancelled += 1
            except httpx.HTTPError as e:
                tally.add("exception", "exception", f"{type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001  (a bug of this client: count it, keep the load on)
                tally.add("client-bug", "exception", f"{type(e).__name__}: {e}")


# ---- the server ----------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("kiln_") and " " in line and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(Path(args.out) / f"soak-{args.model.replace(':', '_').replace('/', '_')}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "kiln.entrypoints.cli", "serve", f"model={args.model}",
                               f"server.port={port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start; see the log beside the results")
            time.sleep(1)
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60
        tally = Tally()
        clients = [threading.Thread(target=client_loop, args=(url, args.model, stop_at, args.seed + i, tally),
                                    daemon=True) for i in range(args.concurrency)]
        for c in clients:
            c.start()
        samples = []
        while time.monotonic() < stop_at:
            g = _gauges(url)
            samples.append({"t_min": (time.monotonic() - t0) / 60, "rss_mib": _rss_mib(server.pid),
                            "running": g.get("kiln_num_requests_running"), "waiting": g.get("kiln_num_requests_waiting"),
                            "kv_blocks_in_use": g.get("kiln_kv_blocks_in_use")})
            print(f"[soak] {samples[-1]}", flush=True)
            time.sleep(min(args.sample_s, max(0.0, stop_at - time.monotonic())))
        for c in clients:
            c.join(600)
        time.sleep(3)  # the engine's stats lag one turn
        final = _gauges(url)
        health = httpx.get(f"{url}/health", timeout=30).status_code
        late = [s["rss_mib"] for s in samples if s["t_min"] >= args.minutes - args.flat_minutes]
        spread_pct = 100 * (max(late) / min(late) - 1) if late else float("nan")
        result = {
            "model": args.model, "minutes": args.minutes, "concurrency": args.concurrency,
            "status_counts": tally.status, "cancelled_streams": tally.cancelled, "errors": tally.errors,
            "bad_inputs_accepted": tally.accepted,
            "requests": sum(tally.status.values()), "health": health,
            "final_running": final.get("kiln_num_requests_running"),
            "final_kv_blocks_in_use": final.get("kiln_kv_blocks_in_use"),
            "rss_first_mib": samples[0]["rss_mib"] if samples else None, "rss_last_mib": samples[-1]["rss_mib"] if samples else None,
            "rss_spread_last_pct": spread_pct, "samples": samples,
        }
        checks = {
            "no_5xx_or_exceptions": not tally.errors,
            "no_bad_input_accepted": not any(k.startswith("bad-accepted") for k in tally.status),
            "healthy": health == 200,
            "drained": final.get("kiln_num_requests_running") == 0 and final.get("kiln_kv_blocks_in_use") == 0,
            "rss_flat": spread_pct <= args.flat_pct,
        }
        result["checks"] = checks
        name = args.model.replace(":", "_").replace("/", "_")
        (Path(args.out) / f"soak-{name}.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
        return 0 if all(checks.values()) else 1
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
