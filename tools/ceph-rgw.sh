#!/usr/bin/env bash
# Start a one-node Ceph cluster (1 monitor, 1 manager, 1 memstore OSD) and a RADOS Gateway
# (S3) on 127.0.0.1, from the Debian packages, for a heavier manual run of the S3 tests:
#
#   bash tools/ceph-rgw.sh                 # installs radosgw ceph-mon ceph-osd if missing
#   eval "$(bash tools/ceph-rgw.sh --env)" # the same, then sets LEDGER_S3_* in this shell
#   python -m pytest -q tests/test_s3.py   # the S3 tests, against RGW
#   bash tools/ceph-rgw.sh --stop          # stop the daemons, remove $CEPH_DIR
#
# Everything lives in $CEPH_DIR (default /tmp/ledger-ceph); the OSD keeps its data in
# memory (memstore, 1 GiB), authentication is off (auth ... = none) and the monitor
# speaks crc mode: a throwaway cluster for tests, never for data. Needs root for apt-get.
# Environment: CEPH_DIR, RGW_PORT (7480), LEDGER_S3_KEY / LEDGER_S3_SECRET (fixed
# test credentials by default).
set -euo pipefail

DIR=${CEPH_DIR:-/tmp/ledger-ceph}
PORT=${RGW_PORT:-7480}
KEY=${LEDGER_S3_KEY:-ledgertestkey}
SECRET=${LEDGER_S3_SECRET:-ledgertestsecret}
CONF=$DIR/ceph.conf
CEPH=(ceph -c "$CONF" --connect-timeout 30)

env_lines() {
    echo "export LEDGER_S3_ENDPOINT=http://127.0.0.1:$PORT"
    echo "export LEDGER_S3_KEY=$KEY"
    echo "export LEDGER_S3_SECRET=$SECRET"
    echo "export LEDGER_S3_BUCKET=ledger-tests"
}

stop() {
    local pids=()
    for pidfile in "$DIR"/run/*.pid; do
        [ -e "$pidfile" ] || continue
        pids+=("$(cat "$pidfile")")
    done
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for _ in $(seq 30); do  # the OSD takes a few seconds to shut down
        local alive=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.5
    done
    rm -rf "$DIR"
}

case "${1:-}" in
--stop)
    stop
    exit 0
    ;;
--env) QUIET=1 ;;
"") QUIET=0 ;;
*)
    echo "usage: $0 [--env | --stop]" >&2
    exit 2
    ;;
esac

log() { if [ "$QUIET" = 0 ]; then echo "$@"; else echo "$@" >&2; fi; }

if ! command -v radosgw >/dev/null || ! command -v ceph-osd >/dev/null || ! command -v ceph-mon >/dev/null; then
    log "installing radosgw ceph-mon ceph-osd"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q radosgw ceph-mon ceph-osd >&2
fi

if [ -e "$DIR/run/rgw.pid" ] && kill -0 "$(cat "$DIR/run/rgw.pid")" 2>/dev/null; then
    log "already running in $DIR"
    [ "$QUIET" = 1 ] && env_lines || env_lines | sed 's/^/  /'
    exit 0
fi
stop
mkdir -p "$DIR"/{mon/ceph-a,osd/ceph-0,mgr/ceph-x,rgw,run,log}

FSID=$(uuidgen)
cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:3300,v1:127.0.0.1:6789]
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
ms mon client mode = crc
ms mon cluster mode = crc
ms mon service mode = crc
ms client mode = crc
ms cluster mode = crc
ms service mode = crc
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon max pg per osd = 1000
run dir = $DIR/run
pid file = $DIR/run/\$name.pid
admin socket = $DIR/run/\$name.asok
log file = $DIR/log/\$name.log
mon data = $DIR/mon/\$cluster-\$id
osd data = $DIR/osd/\$cluster-\$id
mgr data = $DIR/mgr/\$cluster-\$id
osd objectstore = memstore
memstore device bytes = 1073741824
osd max object name len = 460
osd max object namespace len = 64

[client.rgw.a]
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw data = $DIR/rgw
rgw dns name = localhost
pid file = $DIR/run/rgw.pid
EOF

log "monitor"
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:3300,v1:127.0.0.1:6789]" "$DIR/monmap" >/dev/null
ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
ceph-mon -c "$CONF" -i a

log "manager"
ceph-mgr -c "$CONF" -i x

log "OSD (memstore)"
OSD_UUID=$(uuidgen)
OSD_ID=$("${CEPH[@]}" osd new "$OSD_UUID")
ceph-osd -c "$CONF" -i "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" 2>>"$DIR/log/mkfs.log"
ceph-osd -c "$CONF" -i "$OSD_ID" 2>>"$DIR/log/osd-start.log"
for _ in $(seq 60); do
    "${CEPH[@]}" osd stat 2>/dev/null | grep -q "1 up" && break
    sleep 1
done

log "RADOS Gateway on 127.0.0.1:$PORT"
radosgw -c "$CONF" -n client.rgw.a
for _ in $(seq 120); do
    curl -s -o /dev/null "http://127.0.0.1:$PORT" && break
    sleep 1
done
curl -s -o /dev/null "http://127.0.0.1:$PORT" || {
    echo "RGW did not answer on port $PORT; see $DIR/log" >&2
    exit 1
}
radosgw-admin -c "$CONF" user create --uid ledger --display-name ledger \
    --access-key "$KEY" --secret "$SECRET" >/dev/null

log "ready: Ceph RGW at http://127.0.0.1:$PORT (stop with: bash $0 --stop)"
[ "$QUIET" = 1 ] && env_lines || env_lines | sed 's/^/  /'
