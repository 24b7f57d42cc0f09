# Sourced by the scripts: `step PREFIX LABEL CMD...` runs CMD and, while it runs, says every
# 10 s how long it has taken (and, with STEP_LOG set, that log's last line), so a long step
# is never a silent one. CMD's status is step's. It writes to the script's stdout as it was
# when this was sourced (fd 9), so `step ... CMD >log` sends only CMD's output to the log.
exec 9>&1
step() {
  local prefix="$1" label="$2" t0=$SECONDS ticker rc=0
  shift 2
  echo "$prefix: $label" >&9
  # The ticker also ends if the script is gone (a SIGKILL that no trap sees).
  ( trap - EXIT; while sleep 10 && kill -0 $$ 2>/dev/null; do
      last=""; [ -n "${STEP_LOG:-}" ] && last="$(tail -n 1 "$STEP_LOG" 2>/dev/null | cut -c 1-110)"
      echo "$prefix:   ... $((SECONDS - t0)) s${last:+: $last}" >&9
    done ) &
  ticker=$!
  "$@" || rc=$?
  kill "$ticker" 2>/dev/null; wait "$ticker" 2>/dev/null || true
  if [ "$rc" = 0 ] && [ $((SECONDS - t0)) -ge 5 ]; then echo "$prefix:   done in $((SECONDS - t0)) s" >&9; fi
  return "$rc"
}
