"""`scd-serve bench chat`: multi-turn chats over a shared system prompt, the decode worker's
prefix cache on and off, in one run.

A prefill worker (the producer's network namespace) and two real decode workers (the consumer's:
one with `--enable-prefix-caching`, one without) are joined by a link shaped to --bandwidth. Each
chat resends its whole conversation every turn (the shared system prompt, every earlier message
and answer, the new message), as chat clients do; chats take turns between the two workers, so
a load swing hits both alike. Per turn index and method: median TTFT, bytes the transfer carried,
the share of the prompt the prefix cache held, and how often the greedy answer with the cache
equals the one without (and, for a transfer method, local's); then turns 2.. with the cache over
without.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scd_serve.bench import procs
from scd_serve.bench.loadgen import random_prompt
from scd_serve.bench.stats import median
from scd_serve.bench.ttft import open_link, start_client, start_prefill, start_worker
from scd_serve.errors import ConfigError
from scd_serve.planner.shapes import load_shape
from scd_serve.planner.units import fmt_bandwidth, parse_bandwidth

CACHE = {"on": ("--enable-prefix-caching",), "off": ("--no-enable-prefix-caching",)}


def conversations(vocab: int, args) -> tuple[list[int], list[list[list[int]]]]:
    """(the shared system prompt, per chat its user messages), seeded."""
    system = random_prompt(vocab, args.system_tokens, args.seed)
    chats = [[random_prompt(vocab, args.turn_tokens, args.seed + 1 + 1000 * c + t) for t in range(args.turns)]
             for c in range(args.chats)]
    return system, chats


def run_chat(args) -> dict:
    for name in ("chats", "turns", "system_tokens", "turn_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
    for d in (args.producer, args.consumer):
        if not (Path(d) / "config.json").exists():
            raise ConfigError(f"model directory {d} has no config.json; run `scd-serve make-demo-pair` or pass "
                              f"--producer/--consumer", field="model")
    logs = Path(args.json).resolve().parent / "bench-chat-logs"
    logs.mkdir(parents=True, exist_ok=True)
    system, chats = conversations(load_shape(args.consumer).vocab_size, args)
    link = open_link(force_fallback=args.no_netns)
    server, workers, client = None, {}, None
    rows = []
    try:
        server, address = start_prefill(args, link, logs)
        for cache, flags in CACHE.items():
            workers[cache] = start_worker(args, link, address, logs, flags, name=f"decode-cache-{cache}")
        client = start_client(link, logs, args.start_timeout)
        for _, url in workers.values():
            client.ask({"cmd": "ready", "url": url, "timeout_s": args.start_timeout}, args.start_timeout + 10)
        link.set_rate(parse_bandwidth(args.bandwidth))
        body = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        for method in args.methods:
            for c, turns in enumerate(chats):
                for cache, (_, url) in workers.items():
                    got = client.ask({"cmd": "chat", "url": url, "system": system, "turns": turns,
                                      "body": {**body, "scd_method": method}, "timeout_s": args.request_timeout},
                                     args.request_timeout * args.turns + 30)["turns"]
                    rows += [{"method": method, "cache": cache, "chat": c, **t} for t in got]
            print(f"  {method}: {args.chats} chats x {args.turns} turns, cache on and off", file=sys.stderr)
        link_info = link.describe()
    finally:
        if client is not None:
            client.close()
        for proc, _ in workers.values():
            procs.stop(proc)
        procs.stop(server)
        link.down()
    return summarize(rows, args, link_info)


def summarize(rows: list[dict], args, link_info: dict) -> dict:
    """Medians per (method, cache, turn), and turns 2.. with the cache over without."""
    table = []
    for method in args.methods:
        for turn in range(args.turns):
            row = {"method": method, "turn": turn + 1}
            for cache in CACHE:
                got = [r for r in rows if (r["method"], r["cache"], r["turn"]) == (method, cache, turn)]
                row[cache] = {"ttft_ms": round(1e3 * median([r["ttft_s"] for r in got]), 2),
                              "payload_bytes": median([r["payload_bytes"] for r in got]),
                              "cached_share": round(median([r["cached_tokens"] / r["prompt_tokens"] for r in got]), 3),
                              "prompt_tokens": median([r["prompt_tokens"] for r in got]),
                              "served": sorted({r["method"] or "?" for r in got})}
            on, off = row["on"], row["off"]
            row["same_answer_on_off"] = same_answers(rows, (method, "on", turn), (method, "off", turn))
            if method != "local" and "local" in args.methods:  # the consumer's own prefill: the oracle
                row["same_answer_as_local"] = {c: same_answers(rows, (method, c, turn), ("local", c, turn))
                                               for c in CACHE}
            row["ttft_on_over_off"] = round(on["ttft_ms"] / off["ttft_ms"], 3) if off["ttft_ms"] else None
            row["bytes_on_over_off"] = round(on["payload_bytes"] / off["payload_bytes"], 3) if off["payload_bytes"] else None
            table.append(row)
    later = {m: [r for r in table if r["method"] == m and r["turn"] > 1] for m in args.methods}
    return {"bandwidth": fmt_bandwidth(parse_bandwidth(args.bandwidth)), "link": link_info,
            "workload": {k: getattr(args, k) for k in ("chats", "turns", "system_tokens", "turn_tokens", "max_tokens",
                                                      "seed")},
            "table": table, "samples": rows,
            "later_turns": {m: {"ttft_on_over_off": median([r["ttft_on_over_off"] for r in rs if r["ttft_on_over_off"]]),
                                "bytes_on_over_off": median([r["bytes_on_over_off"] for r in rs
                                                             if r["bytes_on_over_off"] is not None])}
                            for m, rs in later.items() if rs}}


def same_answers(rows: list[dict], a: tuple, b: tuple) -> float:
    """The share of chats whose answer at (method, cache, turn) a equals that at b, token for token
    (greedy: a rebuilt cache that changes an answer shows here; so would a stale cached block)."""
    answers = {key: {r["chat"]: r["answer"] for r in rows if (r["method"], r["cache"], r["turn"]) == key}
               for key in (a, b)}
    chats = sorted(set(answers[a]) & set(answers[b]))
    return round(sum(answers[a][c] == answers[b][c] for c in chats) / len(chats), 3) if chats else float("nan")


def print_table(doc: dict) -> None:
    print(f"bench chat: {doc['workload']}, link {doc['link'].get('kind', '?')} at {doc['bandwidth']}")
    print(f"{'method':10} {'turn':>4} {'prompt':>7} | {'TTFT on':>9} {'off':>9} {'on/off':>6} | "
          f"{'bytes on':>10} {'off':>10} | {'cached on':>9}")
    for r in doc["table"]:
        on, off = r["on"], r["off"]
        ratio = f"{r['ttft_on_over_off']:.2f}" if r["ttft_on_over_off"] else "-"
        print(f"{r['method']:10} {r['turn']:>4} {on['prompt_tokens']:>7.0f} | {on['ttft_ms']:>7.1f}ms "
              f"{off['ttft_ms']:>7.1f}ms {ratio:>6} | {on['payload_bytes']:>10.0f} {off['payload_bytes']:>10.0f} | "
              f"{on['cached_share']:>9.0%}")
    for r in doc["table"]:
        local = r.get("same_answer_as_local")
        print(f"{r['method']} turn {r['turn']}: same answer with the cache as without {r['same_answer_on_off']:.0%}"
              + (f"; as local's: on {local['on']:.0%}, off {local['off']:.0%}" if local else ""))
    for m, v in doc["later_turns"].items():
        print(f"{m}: turns 2..: TTFT with the cache / without {v['ttft_on_over_off']}, "
              f"bytes {v['bytes_on_over_off']} (medians)")
