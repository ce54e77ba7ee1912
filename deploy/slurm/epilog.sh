#!/bin/bash
# Slurm Epilog: release the ending job from the A-Dloader agent of this node.
#   slurm.conf:  Epilog=/opt/adloader/slurm/epilog.sh      (see docs/operations.md, "Slurm")
#
# Contract (a failing Epilog drains the node):
# - ALWAYS exits 0, whatever happens to the agent or to this script's own command;
# - bounded twice: the command's own deadline (--timeout-s) and coreutils `timeout`, which kills it;
#   logger(1) is bounded by `timeout` too (a syslog that stopped reading blocks it): about 8 s at most in all;
# - idempotent (releasing a job the agent does not know counts as done);
# - no PATH assumed: every program by absolute path; no Slurm command is called;
# - one log line per call, always on stderr (slurmd logs a prolog's stderr at SlurmdDebug=debug2),
#   and to syslog via logger(1) (tag adloader-epilog) when /dev/log is a socket, else appended
#   to LOG_FILE; "timed out" (agent hung) and "agent down" (nobody listening) are told apart.
# - the agent's endpoint comes from the agent's own config file (AGENT_CONFIG, its endpoint key):
#   one source of truth; slurmd gives this script an empty environment.
# Reads (via the command) SLURM_JOB_ID and SLURM_JOB_UID.

# Install-time lines, set by `adloader install-service` (--prefix DIR sets ADLOADER=DIR/venv/bin/adloader):
ADLOADER=/opt/adloader/venv/bin/adloader
AGENT_CONFIG=/etc/adloader/agent.toml
LOG_FILE=/var/log/adloader/slurm.log
CMD_TIMEOUT_S=2    # the command gives up waiting for the agent after this
HARD_TIMEOUT_S=5   # then `timeout` sends TERM, and KILL one second later
LOG_TIMEOUT_S=1    # logger(1) to syslog: TERM after this, KILL one second later (then LOG_FILE)
# For tests only: ADLOADER_BIN replaces the path above (slurmd never sets it; nothing else reads it).
[ -n "${ADLOADER_BIN:-}" ] && ADLOADER=$ADLOADER_BIN

VERB=release
TAG=adloader-epilog

TIMEOUT=
for t in /usr/bin/timeout /bin/timeout; do
    if [ -x "$t" ]; then TIMEOUT=$t; break; fi
done

log() {
    echo "$TAG: $1" >&2
    local l
    if [ -S /dev/log ]; then   # logger(1) exits 0 even when no syslog socket exists: look first
        for l in /usr/bin/logger /bin/logger; do
            [ -x "$l" ] || continue
            # A syslog daemon that stops reading (journald hung or stopped) blocks logger's send once
            # the socket's queue is full (net.unix.max_dgram_qlen, default 10): bounded, like the command.
            if [ -n "$TIMEOUT" ]; then
                "$TIMEOUT" -k 1 "$LOG_TIMEOUT_S" "$l" -t "$TAG" -- "$1" 2>/dev/null </dev/null && return 0
            else
                "$l" -t "$TAG" -- "$1" 2>/dev/null </dev/null && return 0
            fi
            break   # the one logger failed or timed out: the log file below (another would block too)
        done
    fi
    # no syslog: a file (bash's printf builds the timestamp; no program needed). Only a regular file
    # (or none yet): opening a FIFO that nobody reads blocks for ever, and `timeout` does not bound a
    # redirection of bash's own (before, LOG_FILE a FIFO hung the prolog until PrologEpilogTimeout)
    [ -n "$LOG_FILE" ] && { [ ! -e "$LOG_FILE" ] || [ -f "$LOG_FILE" ]; } && printf '%(%Y-%m-%dT%H:%M:%S%z)T %s[%d]: %s\n' -1 "$TAG" "$$" "$1" 2>/dev/null >>"$LOG_FILE"   # 2> first: a missing log dir is not a bash error on stderr
    return 0
}

if [ ! -x "$ADLOADER" ]; then
    log "job ${SLURM_JOB_ID:-?}: $VERB not sent: $ADLOADER is not an executable (is A-Dloader installed?)"
    exit 0
fi
if [ -n "$TIMEOUT" ]; then
    out=$("$TIMEOUT" -k 1 "$HARD_TIMEOUT_S" "$ADLOADER" job "$VERB" --slurm --config "$AGENT_CONFIG" --timeout-s "$CMD_TIMEOUT_S" 2>&1 </dev/null)
else
    out=$("$ADLOADER" job "$VERB" --slurm --config "$AGENT_CONFIG" --timeout-s "$CMD_TIMEOUT_S" 2>&1 </dev/null)
fi
rc=$?
case $rc in
    0) ;;
    124|137) out="job ${SLURM_JOB_ID:-?}: $VERB timed out: killed after ${HARD_TIMEOUT_S}s (the command or the agent hung): $out" ;;
    *) out="job ${SLURM_JOB_ID:-?}: $VERB exited $rc: $out" ;;
esac
out=${out//$'\n'/ | }
log "${out:-job ${SLURM_JOB_ID:-?}: $VERB: no output}"
exit 0
