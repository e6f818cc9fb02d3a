#!/usr/bin/env bash
# The head of a many-node extraction (README "Many nodes"): PostgreSQL from
# Debian's package (Prefect's database and the stores' index), a Prefect
# server on it, the `eagle3` pool, prefect.yaml deployed, the heartbeat
# automation that marks a dead node's runs Crashed, and a worker for the
# parent runs. Nodes then join with `python -m flows.node`; the line
# to run on each is printed. Ctrl-C stops the worker, the server and
# PostgreSQL.
#
#   EAGLE3_HOST=10.0.0.1 scripts/prefect-nodes.sh     # the address nodes reach
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

HOST="${EAGLE3_HOST:-127.0.0.1}"
PGPORT="${EAGLE3_PGPORT:-5433}"
PORT="${PREFECT_SERVER_API_PORT:-4200}"
PGROOT="${EAGLE3_PGROOT:-$PWD/.cache/postgres}"
prefect=.venv/bin/prefect
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect-nodes}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export EAGLE3_REPO="$PWD"

bin() { command -v "$1" 2>/dev/null || ls -d /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | sort -V | tail -1; }
[ -n "$(bin initdb)" ] || { echo "PostgreSQL is missing: apt-get install -y postgresql" >&2; exit 1; }
# PostgreSQL refuses to run as root: then it runs as `nobody`, from a data
# dir that user owns.
as=()
[ "$(id -u)" = 0 ] && as=(runuser -u nobody --)
if [ ! -f "$PGROOT/data/PG_VERSION" ]; then
  mkdir -p "$PGROOT/data"
  umask 077
  .venv/bin/python -c 'import secrets; print(secrets.token_urlsafe(24))' > "$PGROOT/password"
  cp "$PGROOT/password" "$PGROOT/initdb-pw"  # initdb reads it as the server's user
  if [ "$(id -u)" = 0 ]; then chown nobody "$PGROOT/data" "$PGROOT/initdb-pw"; chmod 755 "$PGROOT"; fi
  "${as[@]}" "$(bin initdb)" -D "$PGROOT/data" -U eagle3 --pwfile "$PGROOT/initdb-pw" -A scram-sha-256 -E UTF8 >/dev/null
  rm "$PGROOT/initdb-pw"
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGROOT/data/pg_hba.conf"
fi
PW="$(cat "$PGROOT/password")"
listen=127.0.0.1; [ "$HOST" != 127.0.0.1 ] && listen="127.0.0.1,$HOST"
"${as[@]}" "$(bin pg_ctl)" -D "$PGROOT/data" -w -l "$PGROOT/data/log" \
  -o "-p $PGPORT -c listen_addresses=$listen -k $PGROOT/data -c max_connections=500" start >/dev/null
for db in prefect eagle3; do
  PGPASSWORD="$PW" "$(bin psql)" -h 127.0.0.1 -p "$PGPORT" -U eagle3 -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname='$db'" | grep -q 1 ||
    PGPASSWORD="$PW" "$(bin createdb)" -h 127.0.0.1 -p "$PGPORT" -U eagle3 "$db"
done

set -m
pids=()
stop() {
  trap - EXIT INT TERM
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    kill -INT -- "-${pids[i]}" 2>/dev/null || continue
    for _ in $(seq 40); do kill -0 -- "-${pids[i]}" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-${pids[i]}" 2>/dev/null || true
  done
  "${as[@]}" "$(bin pg_ctl)" -D "$PGROOT/data" -m fast -w stop >/dev/null || true
}
trap stop EXIT INT TERM

export PREFECT_API_DATABASE_CONNECTION_URL="postgresql+asyncpg://eagle3:$PW@127.0.0.1:$PGPORT/prefect"
export PREFECT_API_URL="http://$HOST:$PORT/api"
PREFECT_SERVER_API_HOST="$HOST" PREFECT_SERVER_API_PORT="$PORT" "$prefect" server start &
pids+=($!)
for _ in $(seq 120); do curl -sf "$PREFECT_API_URL/health" >/dev/null && break; sleep 1; done
curl -sf "$PREFECT_API_URL/health" >/dev/null || { echo "Prefect server did not start" >&2; exit 1; }
unset PREFECT_API_DATABASE_CONNECTION_URL  # the server's alone

"$prefect" work-pool inspect eagle3 >/dev/null 2>&1 || "$prefect" work-pool create eagle3 --type process
"$prefect" --no-prompt deploy --all
.venv/bin/python -c 'from flows.node_runs import ensure_zombie_automation as z; z(90)'
export EAGLE3_LEDGER_URL="postgresql://eagle3:$PW@$HOST:$PGPORT/eagle3"
PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30 "$prefect" worker start --pool eagle3 --work-queue default &
pids+=($!)
cat <<EOF
Prefect UI: ${PREFECT_API_URL%/api}   (Ctrl-C stops the worker, the server and PostgreSQL)
On each node (the store mounted at the same path everywhere), from this checkout:
  PREFECT_API_URL=$PREFECT_API_URL EAGLE3_LEDGER_URL='$EAGLE3_LEDGER_URL' \\
    .venv/bin/python -m flows.node --queue node-1 --server.model MODEL [--server.tp-size 8]
Then run the deployment extract_across_nodes/extract-across-nodes with queues ["node-1", ...].
EOF
wait
