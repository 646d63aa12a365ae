"""Serving throughput and latency at 1, 2, 4 and 16 concurrent clients: with and without speculation,
with and without batching.

Starts the `eaglewire serve` processes of SERVERS (the default, which drafts only
while a request runs alone; the same with drafts looked up in the context too; chain
drafts always; --strategy none; and both without batching; --servers picks some) and,
for each concurrency level, runs the same request set against each
in turn, rotating which goes first. Each client streams greedy chat completions
(MT-bench first turns) with the openai client; time to first token is the
first content chunk. Prints a table and writes benchmarks/results/serve.json.

    python benchmarks/serve.py [--requests 16] [--max-tokens 64] [--servers a,b] [--levels 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from eaglewire.bench.prompts import load_prompts
from eaglewire.serve.launch import LocalServer, launch

RESULTS = Path(__file__).parent / "results" / "serve.json"
LEVELS = (1, 2, 4, 16)


SERVERS = {  # name: (strategy, --max-batch, --draft-up-to, more options)
    "speculative": ("chain", "4", "1", ()),  # the default
    "speculative+lookup": ("chain", "4", "1", ("--lookup-min", "5")),
    "speculative-always": ("chain", "4", "all", ()),
    "plain": ("none", "4", "1", ()),
    "speculative-batch1": ("chain", "1", "1", ()),
    "plain-batch1": ("none", "1", "1", ()),
}
RATIOS = (("speculative", "plain"), ("speculative+lookup", "plain"), ("speculative+lookup", "speculative"),
          ("speculative-always", "plain"), ("speculative-batch1", "plain-batch1"), ("speculative", "speculative-batch1"),
          ("plain", "plain-batch1"))


def start_server(strategy: str, max_batch: str, draft_up_to: str, options: tuple[str, ...]) -> LocalServer:
    return launch(["--strategy", strategy, "--log-interval", "60", "--max-batch", max_batch,
                   "--draft-up-to", draft_up_to, *options])


def one_request(client: openai.OpenAI, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first, tokens, text = None, 0, []
    stream = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=max_tokens, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - start
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens, "text": "".join(text)}


def run_level(url: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda p: one_request(client, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in results)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)

    def pct(values, q):
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]

    return {"clients": clients, "requests": len(results), "wall_s": wall, "requests_per_s": len(results) / wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "latency_p50_s": statistics.median(latencies), "latency_p99_s": pct(latencies, 0.99),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": pct(ttfts, 0.99),
            "texts": [r["text"] for r in results]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests per level and server")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated, from SERVERS (default: all)")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent clients, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    chosen = args.servers.split(",")
    unknown = [name for name in chosen if name not in SERVERS]
    if unknown:
        parser.error(f"--servers: unknown {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    try:
        levels = [int(level) for level in args.levels.split(",")]
    except ValueError:
        parser.error(f"--levels must be comma-separated integers, got {args.levels!r}")
    if min(levels) < 1:
        parser.error(f"--levels must be >= 1, got {args.levels}")
    prompts = [p.text for p in load_prompts("mtbench", args.requests)]
    servers = {name: start_server(*SERVERS[name]) for name in chosen}
    rows = []
    try:
        for index, clients in enumerate(levels):
            names = list(servers)
            for name in names[index:] + names[:index]:
                row = {"server": name, **run_level(servers[name].url, prompts, clients, args.max_tokens)}
                rows.append(row)
                print(f"{name:18s} clients {clients:2d}: {row['requests_per_s']:.2f} req/s, {row['tokens_per_s']:.1f} tok/s, "
                      f"latency p50 {row['latency_p50_s']:.2f} s p99 {row['latency_p99_s']:.2f} s, "
                      f"TTFT p50 {row['ttft_p50_s']:.2f} s p99 {row['ttft_p99_s']:.2f} s", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    same = all(row["texts"] == rows[0]["texts"] for row in rows)
    print(f"greedy answers identical across servers and levels: {same}")

    def tokens_per_s(server: str, clients: int) -> float:
        return next(r["tokens_per_s"] for r in rows if r["server"] == server and r["clients"] == clients)

    ratios = {f"{a} / {b}": {clients: tokens_per_s(a, clients) / tokens_per_s(b, clients) for clients in levels}
              for a, b in RATIOS if a in servers and b in servers}
    for name, by_level in ratios.items():
        print(f"{name + ' tokens/s':40s} " + ", ".join(f"{c} clients {r:.2f}x" for c, r in by_level.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for row in rows:
        row.pop("texts")
    settings = {**vars(args), "out": str(args.out), "threads": os.environ.get("OMP_NUM_THREADS", "torch default")}
    args.out.write_text(json.dumps({"settings": settings, "servers": {name: SERVERS[name] for name in servers},
                                    "rows": rows, "identical_answers": same,
                                    "tokens_per_s_ratios": ratios}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
