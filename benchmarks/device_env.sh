# Source at the start of a device-machine command (bash):  . benchmarks/device_env.sh
# - makes `qerl_kernels` importable from this tree (a symlink under /tmp/qp, as an install would name it);
# - keeps Triton's compile cache between leases: a fresh lease spends most of a 600 s call compiling the
#   Gluon tiles, so the cache is restored from .tcache/triton.tar.xz* (carry `.tcache`, which git ignores)
#   and `tcache_save "$OUT"` packs it back, in 15 MB parts, for the next call to carry (copy them into .tcache here).
# Triton records cache entries by absolute path, so the cache always lives at /tmp/qerl-triton-cache.
mkdir -p /tmp/qp && ln -sfn "$PWD/kernels" /tmp/qp/qerl_kernels
export PYTHONPATH=/tmp/qp:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/qerl-triton-cache
mkdir -p "$TRITON_CACHE_DIR"
_tparts=$(ls .tcache/triton.tar.xz.part-* 2>/dev/null || ls .tcache/triton.tar.xz 2>/dev/null)  # parts, else one file
if [ -n "$_tparts" ]; then
  cat $_tparts | tar -C / -xJf - && echo "triton cache: restored $(find "$TRITON_CACHE_DIR" -name '*.json' | wc -l) files"
fi

tcache_save() {  # tcache_save DIR: DIR/triton.tar.xz.part-aa, -ab, ... (a returned file may take 16 MiB)
  local f="$1/triton.tar.xz"
  rm -f "$f" "$f".part-*
  tar -C / -cf - "${TRITON_CACHE_DIR#/}" | xz -T0 -6 | split -b 15000000 - "$f.part-"
  ls -l "$f".part-*
}

# Prune what no run reads any more (a cache carried from lease to lease keeps every stale kernel):
# tcache_mark before the runs, tcache_prune after them drops each entry none of whose files was read.
# Needs atime updates (relatime does them for atimes older than the mtime, which the mark sets).
tcache_mark() { find "$TRITON_CACHE_DIR" -type f -exec touch -a -d '2000-01-01 00:00' {} +; }
tcache_prune() {
  if [ -z "$(find "$TRITON_CACHE_DIR" -type f -newerat '2001-01-01' -print -quit)" ]; then
    echo "tcache_prune: no file read since tcache_mark (noatime?): nothing pruned"; return
  fi
  local d kept=0 dropped=0
  for d in "$TRITON_CACHE_DIR"/*/; do
    if [ -n "$(find "$d" -type f -newerat '2001-01-01' -print -quit)" ]; then kept=$((kept + 1)); else rm -rf "$d"; dropped=$((dropped + 1)); fi
  done
  echo "tcache_prune: kept $kept entries, dropped $dropped"
}
