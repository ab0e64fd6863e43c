"""`scd-serve bench chat`: multi-turn chats over a shared system prompt, and agent chains where
experts read each other's context, the decode workers' prefix cache on and off, in one run.

A prefill worker (the producer's network namespace) and two real decode workers (the consumer's:
one with `--enable-prefix-caching`, one without) are joined by a link shaped to --bandwidth. Each
chat resends its whole conversation every turn (the shared system prompt, every earlier message
and answer, the new message), as chat clients do; chats take turns between the two workers, so
a load swing hits both alike. With `--expert NAME=DIR[:CODEBOOK]` (another consumer of the same
producer, as `scd-serve up --expert` serves it; two decode workers of its own, cache on and off,
fed by the same prefill worker) each chat is followed by an agent chain: the same kind of
conversation whose turns alternate between the consumer and the expert, so the expert's turns
read the consumer's answers (and the other way round). Per workload, turn index and method:
median TTFT, bytes the transfer carried, the share of the prompt the prefix cache held, and how
often the greedy answer with the cache equals the one without (and, for a transfer method,
local's); then turns 2.. with the cache over without. The producer's own prefix cache (of its
K/V) stays on in both settings: "off" is the decode side's.
"""

from __future__ import annotations

import sys
from pathlib import Path

from scd_serve.bench import procs
from scd_serve.bench.loadgen import random_prompt
from scd_serve.bench.stats import median
from scd_serve.bench.ttft import open_link, start_client, start_prefill, start_worker
from scd_serve.config.expert import parse_experts
from scd_serve.errors import ConfigError
from scd_serve.planner.shapes import load_shape
from scd_serve.planner.units import fmt_bandwidth, parse_bandwidth

CACHE = {"on": ("--enable-prefix-caching",), "off": ("--no-enable-prefix-caching",)}
CONSUMER = "consumer"  # the name of the pair's consumer in a chain's turns


def conversations(vocab: int, args, first_seed: int = 1) -> tuple[list[int], list[list[list[int]]]]:
    """(the shared system prompt, per chat its user messages), seeded; another first_seed gives
    other messages after the same system prompt."""
    system = random_prompt(vocab, args.system_tokens, args.seed)
    chats = [[random_prompt(vocab, args.turn_tokens, args.seed + first_seed + 1000 * c + t) for t in range(args.turns)]
             for c in range(args.chats)]
    return system, chats


def chain_experts(turns: int, expert: str) -> list[str]:
    """Who answers each turn of an agent chain: the consumer first, then the expert, in turn."""
    return [CONSUMER if t % 2 == 0 else expert for t in range(turns)]


def parse_expert(args) -> tuple[str, str, str] | None:
    """--expert NAME=DIR[:CODEBOOK] -> (name, model, codebook or ""), checked; None without one."""
    if not args.expert:
        return None
    from scd_serve.codec import NEEDS_CODEBOOK

    name, model, codebook = parse_experts([args.expert], {CONSUMER})[0]
    if lacking := [m for m in args.methods if m in NEEDS_CODEBOOK and not codebook]:
        raise ConfigError(f"--methods {' '.join(lacking)} need the expert's codebook: --expert {name}={model}:CODEBOOK "
                          f"(from `scd-serve calibrate --consumer {model}`), or codebook-free methods (raw, local)",
                          field="expert")
    return name, model, codebook


def run_chat(args) -> dict:
    for name in ("chats", "turns", "system_tokens", "turn_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1", field=name)
    for d in (args.producer, args.consumer):
        if not (Path(d) / "config.json").exists():
            raise ConfigError(f"model directory {d} has no config.json; run `scd-serve make-demo-pair` or pass "
                              f"--producer/--consumer", field="model")
    expert = parse_expert(args)
    logs = Path(args.json).resolve().parent / "bench-chat-logs"
    logs.mkdir(parents=True, exist_ok=True)
    vocab = load_shape(args.consumer).vocab_size
    system, chats = conversations(vocab, args)
    # other messages, so a chain finds only the system prompt cached
    _, chains = conversations(vocab, args, first_seed=500)
    link = open_link(force_fallback=args.no_netns)
    server, workers, client = None, {}, None
    rows = []
    try:
        expert_flags = ("--expert-codebook", expert[2]) if expert and expert[2] else ()
        server, address = start_prefill(args, link, logs, expert_flags)
        for cache, flags in CACHE.items():
            workers[CONSUMER, cache] = start_worker(args, link, address, logs, flags, name=f"decode-cache-{cache}")
            if expert:
                workers[expert[0], cache] = start_worker(args, link, address, logs, flags,
                                                         name=f"{expert[0]}-cache-{cache}", model=expert[1],
                                                         codebook=expert[2])
        client = start_client(link, logs, args.start_timeout)
        for _, url in workers.values():
            client.ask({"cmd": "ready", "url": url, "timeout_s": args.start_timeout}, args.start_timeout + 10)
        link.set_rate(parse_bandwidth(args.bandwidth))
        body = {"max_tokens": args.max_tokens, "temperature": 0.0, "ignore_eos": True}
        who = {"chat": [CONSUMER] * args.turns, "chain": chain_experts(args.turns, expert[0]) if expert else None}
        for method in args.methods:
            for c in range(args.chats):
                for workload, turns in (("chat", chats[c]), ("chain", chains[c])):
                    if who[workload] is None:
                        continue
                    for cache in CACHE:
                        urls = [workers[w, cache][1] for w in who[workload]]
                        got = client.ask({"cmd": "chat", "url": urls[0], "urls": urls, "system": system, "turns": turns,
                                          "body": {**body, "scd_method": method}, "timeout_s": args.request_timeout},
                                         args.request_timeout * args.turns + 30)["turns"]
                        rows += [{"workload": workload, "method": method, "cache": cache, "chat": c,
                                  "expert": who[workload][t["turn"]], **t} for t in got]
            print(f"  {method}: {args.chats} chats" + (" and agent chains" if expert else "")
                  + f" x {args.turns} turns, cache on and off", file=sys.stderr)
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
    """Medians per (workload, method, cache, turn), and turns 2.. with the cache over without."""
    table = []
    for workload in sorted({r["workload"] for r in rows}, key=["chat", "chain"].index):
        for method in args.methods:
            for turn in range(args.turns):
                got = {cache: [r for r in rows if (r["workload"], r["method"], r["cache"], r["turn"])
                               == (workload, method, cache, turn)] for cache in CACHE}
                row = {"workload": workload, "method": method, "turn": turn + 1, "expert": got["on"][0]["expert"]}
                for cache in CACHE:
                    row[cache] = {"ttft_ms": round(1e3 * median([r["ttft_s"] for r in got[cache]]), 2),
                                  "payload_bytes": median([r["payload_bytes"] for r in got[cache]]),
                                  "cached_share": round(median([r["cached_tokens"] / r["prompt_tokens"]
                                                               for r in got[cache]]), 3),
                                  "prompt_tokens": median([r["prompt_tokens"] for r in got[cache]]),
                                  "served": sorted({r["method"] or "?" for r in got[cache]})}
                on, off = row["on"], row["off"]
                row["same_answer_on_off"] = same_answers(rows, (workload, method, "on", turn),
                                                         (workload, method, "off", turn))
                if method != "local" and "local" in args.methods:  # the consumer's own prefill: the oracle
                    row["same_answer_as_local"] = {c: same_answers(rows, (workload, method, c, turn),
                                                                   (workload, "local", c, turn)) for c in CACHE}
                row["ttft_on_over_off"] = round(on["ttft_ms"] / off["ttft_ms"], 3) if off["ttft_ms"] else None
                row["bytes_on_over_off"] = (round(on["payload_bytes"] / off["payload_bytes"], 3)
                                            if off["payload_bytes"] else None)
                table.append(row)

    def later(workload: str) -> dict:
        out = {}
        for m in args.methods:
            rs = [r for r in table if (r["workload"], r["method"]) == (workload, m) and r["turn"] > 1]
            if rs:
                out[m] = {"ttft_on_over_off": median([r["ttft_on_over_off"] for r in rs if r["ttft_on_over_off"]]),
                          "bytes_on_over_off": median([r["bytes_on_over_off"] for r in rs
                                                       if r["bytes_on_over_off"] is not None])}
        return out

    doc = {"bandwidth": fmt_bandwidth(parse_bandwidth(args.bandwidth)), "link": link_info,
           "workload": {k: getattr(args, k) for k in ("chats", "turns", "system_tokens", "turn_tokens", "max_tokens",
                                                     "seed", "expert")},
           "table": table, "samples": rows, "later_turns": later("chat")}
    if any(r["workload"] == "chain" for r in rows):
        doc["chain_later_turns"] = later("chain")
    return doc


def same_answers(rows: list[dict], a: tuple, b: tuple) -> float:
    """The share of chats whose answer at (workload, method, cache, turn) a equals that at b, token for token
    (greedy: a rebuilt cache that changes an answer shows here; so would a stale cached block)."""
    answers = {key: {r["chat"]: r["answer"] for r in rows if (r["workload"], r["method"], r["cache"], r["turn"]) == key}
               for key in (a, b)}
    chats = sorted(set(answers[a]) & set(answers[b]))
    return round(sum(answers[a][c] == answers[b][c] for c in chats) / len(chats), 3) if chats else float("nan")


def print_table(doc: dict) -> None:
    print(f"bench chat: {doc['workload']}, link {doc['link'].get('kind', '?')} at {doc['bandwidth']}")
    print(f"{'workload':8} {'method':10} {'turn':>4} {'expert':>10} {'prompt':>7} | {'TTFT on':>9} {'off':>9} "
          f"{'on/off':>6} | {'bytes on':>10} {'off':>10} | {'cached on':>9}")
    for r in doc["table"]:
        on, off = r["on"], r["off"]
        ratio = f"{r['ttft_on_over_off']:.2f}" if r["ttft_on_over_off"] else "-"
        print(f"{r['workload']:8} {r['method']:10} {r['turn']:>4} {r['expert']:>10} {on['prompt_tokens']:>7.0f} | "
              f"{on['ttft_ms']:>7.1f}ms {off['ttft_ms']:>7.1f}ms {ratio:>6} | {on['payload_bytes']:>10.0f} "
              f"{off['payload_bytes']:>10.0f} | {on['cached_share']:>9.0%}")
    for r in doc["table"]:
        local = r.get("same_answer_as_local")
        print(f"{r['workload']} {r['method']} turn {r['turn']}: same answer with the cache as without "
              f"{r['same_answer_on_off']:.0%}" + (f"; as local's: on {local['on']:.0%}, off {local['off']:.0%}"
                                                   if local else ""))
    for workload, key in (("chats", "later_turns"), ("agent chains", "chain_later_turns")):
        for m, v in doc.get(key, {}).items():
            print(f"{workload}, {m}: turns 2..: TTFT with the cache / without {v['ttft_on_over_off']}, "
                  f"bytes {v['bytes_on_over_off']} (medians)")
