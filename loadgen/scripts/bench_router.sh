#!/usr/bin/env bash
# KV-aware routing bench (`make bench-router`): two kvtier nodes sharing one
# bucket of a local S3 server (moto_server from target/py-s3, as
# `make bench-s3`), each publishing KV events (--kv-events), and one
# ShareGPT multi-turn replay sent over them by `kvtier-loadgen route` in
# three modes on the same replay (same conversations, same seed):
#   events       a router following every event of both nodes
#   store-only   the same router applying BlockStored only (what a router
#                fed by a tier that never publishes removals knows)
#   round-robin  no index
# Each run starts fresh nodes on a fresh bucket prefix; PAIRS rounds run
# the three modes, in an order that rotates from round to round. The
# summary gives medians and ranges of: the share of the prefix tokens
# reused (lookup hits) that the chosen node served from its own tiers
# (GPU, RAM, NVMe) rather than from S3, tokens/s, and the turn p99; then
# the verdict against the issue's goal (events ≥ 20 points over round
# robin, and above store-only).
#
# The nodes are small on purpose (RAM_GB, DISK_GB): the replay's working
# set is several times what one node holds, so blocks are evicted while
# their conversations go on, and what a router believes of a node can go
# stale. The S3 server is local (loopback, Python), so latencies say
# nothing of a real store: read the shares, counts and ratios.
#
# Each user waits 30 ms per reply token (GENERATION_MODE realistic) before
# the reply's blocks are written and its next turn comes, so 64 users hold
# about 64 conversations open at once: more than the two nodes' local tiers
# hold, so blocks of open conversations are evicted between their turns.
#
# Settings (environment): PAIRS (3), USERS (64), CONVERSATIONS (200),
# GENERATION_MODE (realistic), THINK_MS (100: a user's wait between a
# reply and its next turn; at 0 the next turn reaches the router 1 ms
# after the reply's PUTs, before their events can have; see
# docs/BENCHMARKS.md), MAX_CONTEXT_TOKENS (4096), REPLAY_MAX_S
# (400), BLOCK_BYTES (65536), BLOCK_TOKENS (64), RAM_GB (0.0078125: 128
# blocks), DISK_GB (0.03125: 512 blocks), SEGMENT_MIB (1), OVERLAP_WEIGHT (1),
# SCORE (fleet; or prefix: see loadgen/src/route/router.rs), OUT
# (target/bench/router), BIN (target/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS=${PAIRS:-3}
USERS=${USERS:-64}
CONVERSATIONS=${CONVERSATIONS:-200}
GENERATION_MODE=${GENERATION_MODE:-realistic}
THINK_MS=${THINK_MS:-100}
MAX_CONTEXT_TOKENS=${MAX_CONTEXT_TOKENS:-4096}
REPLAY_MAX_S=${REPLAY_MAX_S:-400}
BLOCK_BYTES=${BLOCK_BYTES:-65536}
BLOCK_TOKENS=${BLOCK_TOKENS:-64}
RAM_GB=${RAM_GB:-0.0078125}
DISK_GB=${DISK_GB:-0.03125}
SEGMENT_MIB=${SEGMENT_MIB:-1}
OVERLAP_WEIGHT=${OVERLAP_WEIGHT:-1}
SCORE=${SCORE:-fleet}
OUT=${OUT:-target/bench/router}
BIN=${BIN:-target/release}
BUCKET=kvtier-bench

rm -rf "$OUT" && mkdir -p "$OUT"
# SCRATCH, PIDS, start and stop (loadgen/scripts/nodes.sh).
source loadgen/scripts/nodes.sh

# moto_server with the bucket: ENDPOINT, AWS_* (loadgen/scripts/moto.sh).
source loadgen/scripts/moto.sh

# start_node NAME PREFIX: a node sharing s3://BUCKET/PREFIX, its KV events on a
# free port.
start_node() {
  start "$1" --shards 1 --block-bytes "$BLOCK_BYTES" --block-tokens "$BLOCK_TOKENS" --disk-gb "$DISK_GB" \
    --segment-mib "$SEGMENT_MIB" --ram-gb "$RAM_GB" \
    --s3-url "s3://$BUCKET/$2" --s3-endpoint "$ENDPOINT" --s3-write-policy through --kv-events tcp://127.0.0.1:0
}

MODES=(events store-only round-robin)
for pair in $(seq "$PAIRS"); do
  # Rotate which mode goes first, so none always runs on a cold machine.
  order=()
  for k in 0 1 2; do order+=("${MODES[$(((pair - 1 + k) % 3))]}"); done
  for mode in "${order[@]}"; do
    start_node a "router-$pair-$mode"
    start_node b "router-$pair-$mode"
    $BIN/kvtier-loadgen route --node "$URL_a" --node "$URL_b" --mode "$mode" --users "$USERS" \
      --conversations "$CONVERSATIONS" --passes 1 --duration-s "$REPLAY_MAX_S" --generation-mode "$GENERATION_MODE" --think-ms "$THINK_MS" \
      --max-context-tokens "$MAX_CONTEXT_TOKENS" --overlap-weight "$OVERLAP_WEIGHT" --score "$SCORE" --seed 1 \
      --out "$OUT/route-$mode-$pair" >"$OUT/route-$mode-$pair.log" 2>&1 || { tail -5 "$OUT/route-$mode-$pair.log" >&2; exit 1; }
    for node in a b; do
      eval "url=\$URL_$node"
      curl -sf "$url/v1/stats" >"$OUT/stats-$mode-$pair-$node.json"
      stop $node
    done
    echo "pair $pair $mode: $(grep -o 'prefix tokens.*' "$OUT/route-$mode-$pair.log" | head -1)"
  done
done

python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
modes = ["events", "store-only", "round-robin"]
load = lambda p: json.load(open(p))
runs = {m: [load(f"{out}/route-{m}-{p}/results.json") for p in range(1, pairs + 1)] for m in modes}
med = statistics.median
def col(m, f): return [f(r) for r in runs[m]]
metrics = {
    "local_share_of_hits_pct": lambda r: 100 * r["local_share_of_hits"],
    "local_share_of_prompts_pct": lambda r: 100 * r["local_share_of_prompts"],
    "tokens_per_s": lambda r: r["tokens_per_s"],
    "turn_p99_ms": lambda r: r["turn_latency"]["p99_us"] / 1000,
    "turns": lambda r: r["turns"],
}
summary = {"pairs": pairs, "config": runs["events"][0]["config"], "modes": {}}
for m in modes:
    s = {k: {"median": med(col(m, f)), "min": min(col(m, f)), "max": max(col(m, f))} for k, f in metrics.items()}
    s["gets_by_tier"] = {t: sum(r["gets_by_tier"].get(t, 0) for r in runs[m]) for t in sorted({t for r in runs[m] for t in r["gets_by_tier"]})}
    s["tokens_local"] = sum(r["tokens_local"] for r in runs[m])
    s["tokens_s3"] = sum(r["tokens_s3"] for r in runs[m])
    s["turns_overpredicted"] = sum(r["turns_overpredicted"] for r in runs[m])
    s["predicted_local_blocks"] = sum(r["predicted_local_blocks"] for r in runs[m])
    s["served_local_prefix_blocks"] = sum(r["served_local_prefix_blocks"] for r in runs[m])
    s["events_received"] = sum(x["events"] for r in runs[m] for x in r["subscribers"])
    s["batches_missed"] = sum(x["missed_batches"] for r in runs[m] for x in r["subscribers"])
    s["errors"] = sum(r["errors"] for r in runs[m])
    s["wrong_bytes"] = sum(r["wrong_bytes"] for r in runs[m])
    s["turns_per_node"] = [r["turns_per_node"] for r in runs[m]]
    summary["modes"][m] = s
share = {m: col(m, metrics["local_share_of_hits_pct"]) for m in modes}
over_rr = [e - r for e, r in zip(share["events"], share["round-robin"])]
over_so = [e - s for e, s in zip(share["events"], share["store-only"])]
summary["events_minus_round_robin_points"] = {"median": med(over_rr), "min": min(over_rr), "max": max(over_rr)}
summary["events_minus_store_only_points"] = {"median": med(over_so), "min": min(over_so), "max": max(over_so)}
met_rr, met_so = med(over_rr) >= 20, med(over_so) > 0
summary["goal_met"] = met_rr and met_so
lines = []
c = summary["config"]
lines.append(f"KV-aware routing: 2 nodes, shared bucket (moto), {c['users']} users, {runs['events'][0]['dataset_conversations']} conversations once, "
             f"generation {c['generation']}, think {c.get('think_ms', 0)} ms, {c['block_tokens']}-token blocks of {c['block_bytes']} bytes, {pairs} runs per mode (medians, ranges)")
lines.append(f"{'mode':<12} {'local % of prefix hits':>24} {'local % of prompts':>20} {'tokens/s':>18} {'turn p99 ms':>18} {'GETs by tier (all runs)':<40}")
for m in modes:
    s = summary["modes"][m]
    r = lambda k, f: f"{s[k]['median']:{f}} ({s[k]['min']:{f}}-{s[k]['max']:{f}})"
    lines.append(f"{m:<12} {r('local_share_of_hits_pct', '.1f'):>24} {r('local_share_of_prompts_pct', '.1f'):>20} {r('tokens_per_s', '.0f'):>18} "
                 f"{r('turn_p99_ms', '.0f'):>18} {json.dumps(s['gets_by_tier'])}")
for m in modes:
    s = summary["modes"][m]
    lines.append(f"  {m}: router believed {s['predicted_local_blocks']} local blocks on the chosen nodes, {s['served_local_prefix_blocks']} served there, "
                 f"{s['turns_overpredicted']} turns over; {s['events_received']} events received, {s['batches_missed']} batches missed; "
                 f"turns per node {s['turns_per_node']}; errors {s['errors']}, wrong bytes {s['wrong_bytes']}")
d1, d2 = summary["events_minus_round_robin_points"], summary["events_minus_store_only_points"]
lines.append(f"events - round robin: {d1['median']:+.1f} points (pairs {d1['min']:+.1f} to {d1['max']:+.1f}); "
             f"events - store-only: {d2['median']:+.1f} points (pairs {d2['min']:+.1f} to {d2['max']:+.1f})")
lines.append(f"verdict: {'MET' if summary['goal_met'] else 'NOT MET'} (goal: >= 20 points over round robin: {'yes' if met_rr else 'no'}; "
             f"above store-only: {'yes' if met_so else 'no'})")
text = "\n".join(lines)
print(text)
open(f"{out}/summary.txt", "w").write(text + "\n")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json and {out}/summary.txt")
PY
