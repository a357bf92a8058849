#!/bin/sh
# Container entrypoint: optionally shape this container's network, then run the command.
#
#   NETDIST_NETEM   tc-netem arguments for the container's outgoing traffic on its default
#                   interface, e.g. "delay 2ms rate 1gbit" or "rate 100mbit delay 10ms"
#                   (needs the NET_ADMIN capability, which docker-compose.yml grants).
#                   Every container shapes its own egress, so a round trip between two
#                   shaped containers sees the delay twice. On kernels without the netem
#                   qdisc, "delay D" and "rate R" are emulated (see docker/netem.py).
#
# A netem setting that cannot be applied is an error (exit 64), not a silent no-op: a
# benchmark that believes it ran on a 100 Mbit link must have run on one.
set -eu

if [ -n "${NETDIST_NETEM:-}" ]; then
    dev=$(ip -o route show default 2>/dev/null \
          | awk '{for (i = 1; i < NF; i++) if ($i == "dev") print $(i + 1)}' | head -n 1)
    dev=${dev:-eth0}
    # shellcheck disable=SC2086 # NETDIST_NETEM is a list of tc arguments
    if tc qdisc replace dev "$dev" root netem $NETDIST_NETEM 2>/tmp/netdist-tc.err; then
        echo "netdist-entrypoint: $dev shaped with netem $NETDIST_NETEM" >&2
    elif grep -q "qdisc kind is unknown" /tmp/netdist-tc.err; then
        # a kernel without the netem qdisc: tbf for the rate, an NFQUEUE daemon for the delay
        # shellcheck disable=SC2086
        if ! netdist-netem apply --dev "$dev" -- $NETDIST_NETEM; then
            echo "netdist-entrypoint: could not emulate netem '$NETDIST_NETEM' on $dev" >&2
            exit 64
        fi
        echo "netdist-entrypoint: $dev shaped with '$NETDIST_NETEM' (tbf + NFQUEUE delay;" \
             "this kernel has no netem qdisc)" >&2
    else
        cat /tmp/netdist-tc.err >&2
        echo "netdist-entrypoint: could not apply netem '$NETDIST_NETEM' on $dev" \
             "(is the NET_ADMIN capability granted?)" >&2
        exit 64
    fi
fi

exec "$@"
