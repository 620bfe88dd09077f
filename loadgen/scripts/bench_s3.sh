#!/usr/bin/env bash
# Shared S3 tier bench (`make bench-s3`): two kvtier nodes, each with its own
# data directory, replaying ShareGPT conversations with the users split
# across them, first without the shared tier (local: each node on its own),
# then with both on one bucket of a local S3 server (moto_server from
# target/py-s3); then a write burst against one node with a small upload
# queue. Pairs alternate local and shared, so each ratio compares figures
# taken minutes apart; the summary gives medians and ranges.
#
# Both nodes replay the same CONVERSATIONS conversations once each
# (--passes 1), in different orders (seeds 1 and 2): a conversation one
# node has replayed is a prefix the other can read from S3 when it gets
# there. The S3 server is local (loopback, Python), so absolute latencies
# say nothing about a real store: read the hit rates, ratios and counts.
#
# Settings (environment): PAIRS, USERS_PER_NODE, CONVERSATIONS,
# GENERATION_MODE, REPLAY_MAX_S, BLOCK_BYTES, BURST_S, BURST_CONCURRENCY,
# BURST_QUEUE_MIB, OUT, BIN (default target/release).
set -euo pipefail
cd "$(dirname "$0")/../.."
PAIRS=${PAIRS:-3}
USERS_PER_NODE=${USERS_PER_NODE:-4}
CONVERSATIONS=${CONVERSATIONS:-32}
GENERATION_MODE=${GENERATION_MODE:-fast}
REPLAY_MAX_S=${REPLAY_MAX_S:-180}
BLOCK_BYTES=${BLOCK_BYTES:-262144}
BURST_S=${BURST_S:-5}
BURST_CONCURRENCY=${BURST_CONCURRENCY:-16}
BURST_QUEUE_MIB=${BURST_QUEUE_MIB:-8}
OUT=${OUT:-target/bench/s3}
BIN=${BIN:-target/release}
BUCKET=kvtier-bench

rm -rf "$OUT" && mkdir -p "$OUT"
# SCRATCH, PIDS, start and stop (loadgen/scripts/nodes.sh).
source loadgen/scripts/nodes.sh

# moto_server with the bucket: ENDPOINT, AWS_* (loadgen/scripts/moto.sh).
source loadgen/scripts/moto.sh

# start_node NAME [flags...]: a one-shard node of this bench's geometry.
start_node() {
  local name=$1; shift
  start "$name" --shards 1 --block-bytes "$BLOCK_BYTES" --disk-gb 2 --ram-gb 0.25 "$@"
}

for pair in $(seq "$PAIRS"); do
  for mode in local shared; do
    s3=()
    [ $mode = shared ] && s3=(--s3-url "s3://$BUCKET/replay-$pair" --s3-endpoint "$ENDPOINT")
    start_node a "${s3[@]}"
    start_node b "${s3[@]}"
    seed=1
    for node in a b; do
      eval "url=\$URL_$node"
      $BIN/kvtier-loadgen replay --target "$url" --users "$USERS_PER_NODE" --conversations "$CONVERSATIONS" --passes 1 \
        --duration-s "$REPLAY_MAX_S" --generation-mode "$GENERATION_MODE" --seed $seed \
        --out "$OUT/replay-$mode-$pair-$node" >"$OUT/replay-$mode-$pair-$node.log" 2>&1 &
      eval "LG_$node=$!"
      seed=$((seed + 1))
    done
    wait "$LG_a" "$LG_b"
    for node in a b; do
      eval "url=\$URL_$node"
      curl -sf "$url/v1/stats" >"$OUT/stats-$mode-$pair-$node.json"
      stop $node
    done
    echo "pair $pair $mode done"
  done
done

# Write burst: BURST_CONCURRENCY PUTs in flight for BURST_S against one node
# whose write-behind queue holds BURST_QUEUE_MIB; then how the queue drains.
# The same burst without the shared tier first, as the PUT-rate reference.
for mode in local shared; do
  s3=()
  [ $mode = shared ] && s3=(--s3-url "s3://$BUCKET/burst" --s3-endpoint "$ENDPOINT" --s3-upload-queue-mib "$BURST_QUEUE_MIB")
  start_node w "${s3[@]}"
  $BIN/kvtier-loadgen blocks --target "$URL_w" --op put --concurrency "$BURST_CONCURRENCY" --duration-s "$BURST_S" \
    --out "$OUT/burst-$mode" >"$OUT/burst-$mode.log" 2>&1
  : >"$OUT/burst-$mode-queue.jsonl"
  if [ $mode = shared ]; then
    started=$(date +%s.%N)
    for _ in $(seq 1200); do
      curl -sf "$URL_w/v1/stats" | python3 -c "import json,sys,time; t=json.load(sys.stdin)['s3']['totals']; t['t_s']=time.time()-$started; print(json.dumps(t))" \
        >>"$OUT/burst-$mode-queue.jsonl"
      tail -1 "$OUT/burst-$mode-queue.jsonl" | python3 -c 'import json,sys; t=json.load(sys.stdin); sys.exit(0 if t["uploads_unfinished"]==0 else 1)' && break
      sleep 0.25
    done
  fi
  curl -sf "$URL_w/v1/stats" >"$OUT/stats-burst-$mode.json"
  stop w
done

python3 - "$OUT" "$PAIRS" <<'PY'
import json, statistics, sys
out, pairs = sys.argv[1], int(sys.argv[2])
def load(p): return json.load(open(p))
rows = {"local": [], "shared": []}
for pair in range(1, pairs + 1):
    for mode in rows:
        r = [load(f"{out}/replay-{mode}-{pair}-{n}/results.json") for n in "ab"]
        s = [load(f"{out}/stats-{mode}-{pair}-{n}.json") for n in "ab"]
        looked = sum(x["tokens_looked_up"] for x in r)
        s3 = [x["s3"]["totals"] for x in s if x.get("s3")]
        rows[mode].append(dict(
            pair=pair,
            hit_rate=sum(x["tokens_hit"] for x in r) / looked if looked else 0.0,
            hit_rate_per_node=[x["prefix_hit_rate"] for x in r],
            tokens_per_s=sum(x["tokens_per_s"] for x in r),
            turns=sum(x["turns"] for x in r),
            blocks_read=sum(x["blocks_read"] for x in r),
            blocks_written=sum(x["blocks_written"] for x in r),
            errors=sum(x["errors"] for x in r), wrong_bytes=sum(x["wrong_bytes"] for x in r),
            gets_by_tier={t: sum(x["get_latency_by_tier"].get(t, {}).get("count", 0) for x in r)
                          for t in sorted({t for x in r for t in x["get_latency_by_tier"]})},
            s3={k: sum(t.get(k, 0) for t in s3) for k in (
                "uploads_done", "uploads_present", "uploads_dropped", "uploads_failed", "reads", "read_hits",
                "read_misses", "read_errors", "read_corrupt", "installs", "exists_checks", "presence_cache_hits")} if s3 else None,
        ))
summary = {"replay": rows}
med = lambda xs: statistics.median(xs)
hr = {m: [x["hit_rate"] for x in v] for m, v in rows.items()}
tp = {m: [x["tokens_per_s"] for x in v] for m, v in rows.items()}
ratios_tp = [s / l for s, l in zip(tp["shared"], tp["local"]) if l]
summary["hit_rate_median"] = {m: med(v) for m, v in hr.items()}
summary["tokens_per_s_ratio_shared_over_local"] = {"median": med(ratios_tp), "min": min(ratios_tp), "max": max(ratios_tp)}
print(f"replay: 2 nodes x users split, {pairs} pairs")
print(f"{'mode':>7} {'hit rate (median, range)':>28} {'tokens/s both nodes (median)':>30} {'errors':>7} {'wrong':>6}")
for m in rows:
    print(f"{m:>7} {med(hr[m]):>12.3f} ({min(hr[m]):.3f}-{max(hr[m]):.3f}) {med(tp[m]):>30.0f} "
          f"{sum(x['errors'] for x in rows[m]):>7} {sum(x['wrong_bytes'] for x in rows[m]):>6}")
print(f"tokens/s shared/local: median {med(ratios_tp):.2f} (range {min(ratios_tp):.2f}-{max(ratios_tp):.2f})")
for m in rows:
    for x in rows[m]:
        print(f"  {m} pair {x['pair']}: GETs by tier {x['gets_by_tier']}" + (f"; s3 {x['s3']}" if x["s3"] else ""))

burst = {}
for mode in ("local", "shared"):
    r = load(f"{out}/burst-{mode}/results.json")
    st = load(f"{out}/stats-burst-{mode}.json")
    burst[mode] = dict(puts=r["requests"], errors=r["errors"], puts_per_s=r["requests"] / r["elapsed_s"], p50_us=r["latency"]["p50_us"],
                       p99_us=r["latency"]["p99_us"], s3=st["s3"]["totals"] if st.get("s3") else None)
samples = [json.loads(l) for l in open(f"{out}/burst-shared-queue.jsonl") if l.strip()]
burst["shared"]["drain_s"] = samples[-1]["t_s"] if samples else None
burst["shared"]["queue_blocks"] = load(f"{out}/stats-burst-shared.json")["s3"]["upload_queue_blocks"]
burst["put_rate_ratio_shared_over_local"] = burst["shared"]["puts_per_s"] / burst["local"]["puts_per_s"]
summary["burst"] = burst
s = burst["shared"]["s3"]
print(f"burst: {burst['local']['puts']} PUTs without S3, {burst['shared']['puts']} with (rate ratio {burst['put_rate_ratio_shared_over_local']:.2f}, "
      f"p99 {burst['local']['p99_us']/1000:.1f} vs {burst['shared']['p99_us']/1000:.1f} ms, errors {burst['local']['errors']}/{burst['shared']['errors']})")
print(f"  queue {burst['shared']['queue_blocks']} blocks: max queued {s['uploads_queued_max']}, uploaded {s['uploads_done']}, "
      f"dropped {s['uploads_dropped']}, failed {s['uploads_failed']}; drained {burst['shared']['drain_s']:.1f} s after the burst")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
