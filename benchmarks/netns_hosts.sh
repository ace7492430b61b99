#!/usr/bin/env bash
# Run one command per "host" in H network namespaces joined by a switch: a multi-node job on one machine.
#
#   sudo benchmarks/netns_hosts.sh [-H HOSTS] [-r RATE] [-m MTU] [-c COUNTERS_FILE] -- COMMAND [ARGS...]
#
# Builds namespaces <tag>h0 .. <tag>h{H-1} (tag = dxh<pid>; default H=2), each with loopback and one
# veth end "eth0" at 10.78.0.(i+1)/24, and a switch namespace <tag>sw holding a bridge with the
# other veth ends. Inter-host traffic crosses veth -> bridge -> veth; traffic between ranks of
# one host stays on that namespace's loopback (fast, unshaped). RATE (default none) shapes each
# host's link in both directions with `tc qdisc ... tbf rate RATE burst 128kb latency 50ms` on
# both veth ends (e.g. 1gbit). Then runs COMMAND once per host, at once, inside its namespace,
# with NODE_RANK=i, NNODES=H, MASTER_ADDR=10.78.0.1, HOST_ADDR=10.78.0.(i+1) and
# GLOO_SOCKET_IFNAME=eth0 in the environment; the placeholders {node}, {nnodes}, {addr} and
# {master} in COMMAND are replaced by the same. COMMAND is normally a launcher that starts this
# host's ranks (deepspeed --no_ssh --node_rank {node}, torchrun --node_rank {node}); see
# docs/multinode.md. Traffic only flows between these namespaces. The namespaces (and with them
# the veths, the bridge and the qdiscs) are ALWAYS removed on exit, also on errors and Ctrl-C.
# The bytes each host's eth0 transmitted during COMMAND are written as JSON to COUNTERS_FILE.
# Exit status: that of COMMAND (the first failing host's).
set -euo pipefail

HOSTS=2
RATE=none
COUNTERS=""
MTU=1500
while getopts "H:r:m:c:h" opt; do
  case "$opt" in
    H) HOSTS="$OPTARG" ;;
    r) RATE="$OPTARG" ;;
    m) MTU="$OPTARG" ;;
    c) COUNTERS="$OPTARG" ;;
    h) sed -n '2,21p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "netns_hosts.sh: no command given (see -h)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "netns_hosts.sh: needs root (ip netns, tc)" >&2; exit 2; }
command -v ip >/dev/null || { echo "netns_hosts.sh: needs iproute2 (ip)" >&2; exit 2; }
[ "$HOSTS" -ge 1 ] && [ "$HOSTS" -le 200 ] || { echo "netns_hosts.sh: -H $HOSTS: allowed 1..200" >&2; exit 2; }

TAG="dxh$$"
SW="${TAG}sw"
NS=()
PIDS=()
for ((i = 0; i < HOSTS; i++)); do NS+=("${TAG}h$i"); done
MASTER="10.78.0.1"

cleanup() {
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  for ns in "${NS[@]}" "$SW"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$SW"
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
for ((i = 0; i < HOSTS; i++)); do
  ns="${NS[$i]}"
  ip netns add "$ns"
  ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$ns"
  ip -n "$SW" link set "p$i" master br0 mtu "$MTU" up
  ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 mtu "$MTU" up
  if [ "$RATE" != "none" ]; then
    tc -n "$ns" qdisc replace dev eth0 root tbf rate "$RATE" burst 128kb latency 50ms
    tc -n "$SW" qdisc replace dev "p$i" root tbf rate "$RATE" burst 128kb latency 50ms
  fi
done

tx_bytes() { ip netns exec "${NS[$1]}" cat /sys/class/net/eth0/statistics/tx_bytes; }
before=()
for ((i = 0; i < HOSTS; i++)); do before+=("$(tx_bytes "$i")"); done

for ((i = 0; i < HOSTS; i++)); do
  args=()
  for a in "$@"; do
    a="${a//\{node\}/$i}"; a="${a//\{nnodes\}/$HOSTS}"; a="${a//\{addr\}/10.78.0.$((i + 1))}"
    args+=("${a//\{master\}/$MASTER}")
  done
  setsid ip netns exec "${NS[$i]}" env NODE_RANK="$i" NNODES="$HOSTS" MASTER_ADDR="$MASTER" \
    HOST_ADDR="10.78.0.$((i + 1))" GLOO_SOCKET_IFNAME=eth0 "${args[@]}" &
  PIDS+=("$!")
done
status=0
for pid in "${PIDS[@]}"; do
  wait "$pid" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
done
PIDS=()

if [ -n "$COUNTERS" ]; then
  tx=()
  for ((i = 0; i < HOSTS; i++)); do tx+=($(( $(tx_bytes "$i") - before[i] ))); done
  (IFS=,; printf '{"rate": "%s", "hosts": %d, "tx_bytes": [%s]}\n' "$RATE" "$HOSTS" "${tx[*]}") > "$COUNTERS"
fi
exit "$status"
