#!/usr/bin/env bash
# Model-check specs/model/lease.pml with spin (exhaustive safety search).
#
#   specs/model/check.sh            the correct model: must report "errors: 0"
#   BUG=1 specs/model/check.sh      the broken variant BUG_CACHED_VALIDATE: must fail
#   BUG=no_epoch_cas|blind_retry|epoch_wrap|cached_validate|clock_before_lock \
#     specs/model/check.sh
#   SPIN_DEFINES="-DMAX_FAULTS=2" PAN_CFLAGS=-DCOLLAPSE PAN_MEMLIM_MB=12000 \
#     specs/model/check.sh          wider bounds (slower; see README.md)
#
# Exit status: 0 the search completed with no error; 1 spin found a violation (the trail is
# replayed on stdout); 2 the check could not run or did not complete (spin or a C compiler
# missing, build failure, memory or depth limit hit, or a REACH path never explored);
# 3 a BUG variant was searched exhaustively and NOT caught. Every generated file (pan.c,
# pan, the trail) lives in a temporary directory that is removed on exit.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
model="$here/lease.pml"
cc="${CC:-gcc}"
memlim_mb="${PAN_MEMLIM_MB:-4096}"
read -r -a pan_cflags <<< "${PAN_CFLAGS:-}"

if ! command -v spin >/dev/null 2>&1; then
  echo "check.sh: spin is not installed; install it with: apt-get install spin" >&2
  exit 2
fi
if ! command -v "$cc" >/dev/null 2>&1; then
  echo "check.sh: C compiler '$cc' not found (pan is compiled C); apt-get install gcc" >&2
  exit 2
fi

bug="${BUG:-}"
defines=()
search_flags=(-DSAFETY)
case "$bug" in
  "" | 0) ;;
  1 | cached_validate) defines+=(-DBUG_CACHED_VALIDATE) ;;
  no_epoch_cas) defines+=(-DBUG_NO_EPOCH_CAS) ;;
  blind_retry) defines+=(-DBUG_BLIND_RETRY) ;;
  epoch_wrap) defines+=(-DBUG_EPOCH_WRAP) ;;
  clock_before_lock) defines+=(-DBUG_CLOCK_BEFORE_LOCK) ;;
  *)
    echo "check.sh: unknown BUG=$bug (use 1, cached_validate, no_epoch_cas, blind_retry," \
         "epoch_wrap, clock_before_lock)" >&2
    exit 2 ;;
esac
if [[ ${#defines[@]} -gt 0 ]]; then
  # Breadth-first, so the counterexample printed is a shortest one.
  search_flags+=(-DBFS)
fi
# Extra model bounds, e.g. SPIN_DEFINES="-DMAX_FAULTS=2 -DMAX_TICK=4".
read -r -a extra <<< "${SPIN_DEFINES:-}"
defines+=("${extra[@]}")

work="$(mktemp -d "${TMPDIR:-/tmp}/mos-lease-model.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp "$model" "$work/lease.pml"
cd "$work"

echo "== spin -a ${defines[*]} lease.pml  ($(spin -V))"
if ! spin -a "${defines[@]}" lease.pml > spin.out 2>&1; then
  cat spin.out >&2
  echo "check.sh: spin -a failed" >&2
  exit 2
fi
echo "== $cc -O2 ${search_flags[*]} ${pan_cflags[*]} -DMEMLIM=$memlim_mb -o pan pan.c"
# -w: gcc's -Wstringop-overflow misreads spin's bounds-checked array stores in pan.b.
if ! "$cc" -O2 "${search_flags[@]}" "${pan_cflags[@]}" -DMEMLIM="$memlim_mb" -w -o pan pan.c \
    > cc.out 2>&1; then
  cat cc.out >&2
  echo "check.sh: compiling pan failed" >&2
  exit 2
fi

echo "== ./pan -m1000000 -w25"
set +e
./pan -m1000000 -w25 > pan.out 2>&1
pan_rc=$?
set -e
# The summary without the progress lines and the long list of unreached inlined copies.
awk '/^\(Spin Version/ { r = 1 } /^unreached/ { r = 0 } r || /^pan:/' pan.out || true

errors="$(sed -n 's/.*errors: \([0-9][0-9]*\).*/\1/p' pan.out | tail -n 1)"
if [[ -z "$errors" ]]; then
  echo "check.sh: pan did not report a result (exit $pan_rc)" >&2
  exit 2
fi
if [[ "$errors" != 0 ]]; then
  echo "== counterexample: spin -T -t ${defines[*]} lease.pml (the model's narrative;" \
       "add -p for every statement)"
  spin -T -t "${defines[@]}" lease.pml > trail.out 2>&1 || true
  # Drop spin's notice that the REACH(n) coverage probes (embedded C, outside the state)
  # are not executed in a replay; they do not affect any model variable.
  sed -n '1,/trail ends/p' trail.out \
    | awk '/^spin: warning: c_code/ { skip = 1 }
           skip && /=====warning====/ { if (++bars == 2) { skip = 0; next } }
           !skip' \
    | grep -vE '^c_code[0-9]+:|^[[:space:]]*$' || true
  echo "check.sh: VIOLATION: spin found $errors error(s)${bug:+ in variant BUG=$bug}"
  exit 1
fi
if grep -qE 'max search depth too small|out of memory|MEMLIM bound|[Ss]earch not completed' pan.out
then
  echo "check.sh: the search did not complete (depth or memory limit); result is not a proof" >&2
  exit 2
fi
if [[ $pan_rc -ne 0 ]]; then
  echo "check.sh: pan exited with status $pan_rc" >&2
  exit 2
fi
if [[ -n "$bug" && "$bug" != 0 ]]; then
  echo "check.sh: BUG=$bug was NOT caught: the model cannot tell it from the correct one" >&2
  exit 3
fi
# Vacuity check: every REACH(n) marker in the model (the refusal at the maximum epoch, a
# preempting takeover, a lost CAS, both reconciliation outcomes, a successful validation, a
# stale-epoch grant refused, a pre-restart grant refused, a retried write) must have been
# executed by the search, or the bounds are too small for the properties to mean anything.
vacuous=0
while IFS=: read -r line text; do
  n="$(sed -n 's/.*REACH(\([0-9][0-9]*\)).*/\1/p' <<< "$text")"
  if ! grep -qx "REACHED $n" pan.out; then
    echo "check.sh: never reached under these bounds: REACH($n) at lease.pml:$line:" \
         "$(sed -n 's/.*\/\*[[:space:]]*\(.*[^[:space:]]\)[[:space:]]*\*\/.*/\1/p' <<< "$text")" >&2
    vacuous=1
  fi
done < <(grep -n 'REACH([0-9][0-9]*)' lease.pml)
if [[ $vacuous -ne 0 ]]; then
  echo "check.sh: some REACH paths were never explored; widen the bounds" >&2
  exit 2
fi
echo "check.sh: all $(grep -c 'REACH([0-9][0-9]*)' lease.pml) REACH paths explored"
echo "check.sh: OK: exhaustive search, errors: 0${bug:+ (variant BUG=$bug)}"
