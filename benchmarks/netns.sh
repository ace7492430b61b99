#!/usr/bin/env bash
# Run a 2-rank command in two network namespaces joined by a bandwidth-shaped veth pair.
#
#   sudo benchmarks/netns.sh [-r RATE] [-p PORT] [-m MTU] [-c COUNTERS_FILE] -- COMMAND [ARGS...]
#
# Builds namespaces <tag>a (10.77.0.1) and <tag>b (10.77.0.2), tag = dx<pid>, with one veth
# end in each, shapes both ends with `tc qdisc ... tbf rate RATE burst 128kb latency 50ms`
# (RATE "none": unshaped), sets the MTU of both ends (default 1500; 9000 = jumbo frames,
# which cuts the kernel's per-packet CPU cost on a small machine), then runs COMMAND twice at once: as rank 0 inside <tag>a and as
# rank 1 inside <tag>b, with RANK, LOCAL_RANK, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1,
# MASTER_ADDR=10.77.0.1, MASTER_PORT and GLOO_SOCKET_IFNAME set. COMMAND may use the
# placeholder {rank}, replaced by the rank. Traffic only flows between these two
# namespaces. The namespaces (and with them the veth pair and qdiscs) are ALWAYS removed on
# exit, also on errors and Ctrl-C. The bytes each veth end transmitted during COMMAND
# (kernel counters, so including TCP/IP headers) are written as JSON to COUNTERS_FILE.
# Exit status: that of COMMAND (the first failing rank's).
set -euo pipefail

RATE=1gbit
PORT=29555
COUNTERS=""
MTU=1500
while getopts "r:p:m:c:h" opt; do
  case "$opt" in
    r) RATE="$OPTARG" ;;
    p) PORT="$OPTARG" ;;
    m) MTU="$OPTARG" ;;
    c) COUNTERS="$OPTARG" ;;
    h) sed -n '2,19p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "netns.sh: no command given (see -h)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "netns.sh: needs root (ip netns, tc)" >&2; exit 2; }

TAG="dx$$"
NS=("${TAG}a" "${TAG}b")
VETH=("${TAG}v0" "${TAG}v1")
ADDR=("10.77.0.1" "10.77.0.2")
PIDS=()

cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

for ns in "${NS[@]}"; do ip netns add "$ns"; done
ip link add "${VETH[0]}" type veth peer name "${VETH[1]}"
for i in 0 1; do
  ip link set "${VETH[$i]}" netns "${NS[$i]}"
  ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${VETH[$i]}"
  ip -n "${NS[$i]}" link set lo up
  ip -n "${NS[$i]}" link set "${VETH[$i]}" mtu "$MTU"
  ip -n "${NS[$i]}" link set "${VETH[$i]}" up
  if [ "$RATE" != "none" ]; then
    tc -n "${NS[$i]}" qdisc replace dev "${VETH[$i]}" root tbf rate "$RATE" burst 128kb latency 50ms
  fi
done

tx_bytes() { ip netns exec "${NS[$1]}" cat "/sys/class/net/${VETH[$1]}/statistics/tx_bytes"; }
before=("$(tx_bytes 0)" "$(tx_bytes 1)")

for i in 0 1; do
  args=()
  for a in "$@"; do args+=("${a//\{rank\}/$i}"); done
  ip netns exec "${NS[$i]}" env RANK="$i" LOCAL_RANK="$i" WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 \
    MASTER_ADDR="${ADDR[0]}" MASTER_PORT="$PORT" GLOO_SOCKET_IFNAME="${VETH[$i]}" "${args[@]}" &
  PIDS+=("$!")
done
status=0
for pid in "${PIDS[@]}"; do
  wait "$pid" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
done
PIDS=()

after=("$(tx_bytes 0)" "$(tx_bytes 1)")
if [ -n "$COUNTERS" ]; then
  printf '{"rate": "%s", "tx_bytes": [%d, %d]}\n' "$RATE" \
    $((after[0] - before[0])) $((after[1] - before[1])) > "$COUNTERS"
fi
exit "$status"
