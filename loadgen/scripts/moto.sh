# Sourced by the shared-tier benches (bench_s3.sh, bench_router.sh), after
# they set OUT and BUCKET and source nodes.sh (SCRATCH, PIDS killed at exit): starts
# moto_server (target/py-s3) on a free loopback port in $SCRATCH, logging
# to $OUT/moto.log, creates the bucket, and sets ENDPOINT and the AWS_*
# variables kvtier reads. Exits 2 naming the make target when moto is
# missing.
MOTO=target/py-s3/bin/moto_server
[ -x "$MOTO" ] || { echo "$MOTO is missing: run make target/py-s3/.installed" >&2; exit 2; }
MOTO_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
ENDPOINT=http://127.0.0.1:$MOTO_PORT
# moto checks no signature but treats requests without one as anonymous.
AUTH='Authorization: AWS4-HMAC-SHA256 Credential=bench/20260101/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00'
(cd "$SCRATCH" && exec "$OLDPWD/$MOTO" -H 127.0.0.1 -p "$MOTO_PORT") >"$OUT/moto.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 300); do curl -sf -X PUT -H "$AUTH" "$ENDPOINT/$BUCKET" >/dev/null && break; sleep 0.1; done
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_REGION=us-east-1
