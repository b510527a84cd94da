#!/usr/bin/env bash
# Run the README's two commands as a stranger would: a fresh clone of HEAD in a temp dir, the lock
# file's environment, once plain and once under another OpenBLAS kernel with two busy processes
# beside it (the machine of issue 20: other kernel, loaded). Prints each run's pytest summary and
# times; exits 1 if a command failed.
#
#   bash tools/fresh_clone.sh                        # plain, then Prescott + load
#   RUNS="plain Haswell+load" bash tools/fresh_clone.sh
#   KEEP=1 bash tools/fresh_clone.sh                 # keep the temp dir (its path is printed)
#
# A run is KERNEL or KERNEL+load; KERNEL is plain (OPENBLAS_CORETYPE unset) or an OpenBLAS core
# name (Haswell, SkylakeX, Zen, Prescott, ...). Only committed work is cloned.
set -uo pipefail
top=$(git rev-parse --show-toplevel) || exit 1
commit=$(git -C "$top" rev-parse HEAD)
runs=${RUNS:-"plain Prescott+load"}
tmp=$(mktemp -d -t partir-emu-fresh-XXXXXX)
busy=()
cleanup() {
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done
  [ -n "${KEEP:-}" ] && echo "kept $tmp" || rm -rf "$tmp"
}
# a stop ends the script (the EXIT trap cleans up); trapping INT/TERM with cleanup alone went on
# with the next run in the removed dir
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# the README's first two code blocks are its two commands
mapfile -t cmds < <(awk '/^```/{f=!f; next} f && NF' "$top/README.md" | head -n 2)
if [ "${#cmds[@]}" -ne 2 ]; then echo "README.md does not open with two commands"; exit 1; fi
echo "commit $commit; the README's commands: '${cmds[0]}' and '${cmds[1]}'; runs: $runs"

status=0
summary=()
for run in $runs; do
  kernel=${run%%+*}
  dir="$tmp/$run"
  git clone -q --no-local "$top" "$dir" && git -C "$dir" checkout -q "$commit" || exit 1
  env_args=(-u OPENBLAS_CORETYPE)
  [ "$kernel" != plain ] && env_args+=("OPENBLAS_CORETYPE=$kernel")
  if [[ "$run" == *+load ]]; then
    for _ in 1 2; do (while :; do :; done) & busy+=($!); done
  fi
  for c in "${cmds[@]}"; do
    log="$dir/$(echo "$c" | tr -c 'a-z0-9' '-').log"
    start=$(date +%s)
    (cd "$dir" && env "${env_args[@]}" bash -c "$c") >"$log" 2>&1
    rc=$?
    secs=$(( $(date +%s) - start ))
    line=$(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)
    summary+=("$run: '$c' exit $rc in ${secs} s ${line:+-- $line}")
    echo "${summary[-1]}"
    if [ $rc -ne 0 ]; then status=1; tail -n 30 "$log"; fi
  done
  for p in "${busy[@]}"; do kill "$p" 2>/dev/null; done
  busy=()
done
echo
echo "== summary (commit ${commit:0:10}) =="
printf '%s\n' "${summary[@]}"
exit $status
