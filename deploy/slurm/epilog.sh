#!/bin/bash
# Slurm Epilog: release the ending job from the A-Dloader agent of this node.
#   slurm.conf:  Epilog=/opt/adloader/slurm/epilog.sh      (see docs/operations.md, "Slurm")
#
# Contract (a failing Epilog drains the node):
# - ALWAYS exits 0, whatever happens to the agent or to this script's own command;
# - bounded twice: the command's own deadline (--timeout-s) and coreutils `timeout`, which kills it;
# - idempotent (releasing a job the agent does not know counts as done);
# - no PATH assumed: every program by absolute path; no Slurm command is called;
# - one log line per call: logger(1) (syslog, tag adloader-epilog, copy on stderr), else stderr.
# Reads (via the command) SLURM_JOB_ID and SLURM_JOB_UID.

# The installed command. `adloader install-service --prefix DIR` sets this line to DIR/venv/bin/adloader.
ADLOADER=/opt/adloader/venv/bin/adloader
CMD_TIMEOUT_S=2    # the command gives up waiting for the agent after this
HARD_TIMEOUT_S=5   # then `timeout` sends TERM, and KILL one second later
# For tests only: ADLOADER_BIN replaces the path above (slurmd never sets it; nothing else reads it).
[ -n "${ADLOADER_BIN:-}" ] && ADLOADER=$ADLOADER_BIN

VERB=release
TAG=adloader-epilog

log() {
    if [ -x /usr/bin/logger ] && /usr/bin/logger -s -t "$TAG" -- "$1" 2>/dev/null; then return; fi
    if [ -x /bin/logger ] && /bin/logger -s -t "$TAG" -- "$1" 2>/dev/null; then return; fi
    echo "$TAG: $1" >&2
}

if [ ! -x "$ADLOADER" ]; then
    log "job ${SLURM_JOB_ID:-?}: $VERB not sent: $ADLOADER is not an executable (is A-Dloader installed?)"
    exit 0
fi
TIMEOUT=
for t in /usr/bin/timeout /bin/timeout; do
    if [ -x "$t" ]; then TIMEOUT=$t; break; fi
done
if [ -n "$TIMEOUT" ]; then
    out=$("$TIMEOUT" -k 1 "$HARD_TIMEOUT_S" "$ADLOADER" job "$VERB" --slurm --timeout-s "$CMD_TIMEOUT_S" 2>&1 </dev/null)
else
    out=$("$ADLOADER" job "$VERB" --slurm --timeout-s "$CMD_TIMEOUT_S" 2>&1 </dev/null)
fi
rc=$?
case $rc in
    0) ;;
    124|137) out="job ${SLURM_JOB_ID:-?}: $VERB killed after ${HARD_TIMEOUT_S}s (python or agent hung): $out" ;;
    *) out="job ${SLURM_JOB_ID:-?}: $VERB exited $rc: $out" ;;
esac
out=${out//$'\n'/ | }
log "${out:-job ${SLURM_JOB_ID:-?}: $VERB: no output}"
exit 0
