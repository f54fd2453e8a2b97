# Source at the start of a device-machine command (bash):  . benchmarks/device_env.sh
# - makes `qerl_kernels` importable from this tree (a symlink under /tmp/qp, as an install would name it);
# - keeps Triton's compile cache between leases: a fresh lease spends most of a 600 s call compiling the
#   Gluon tiles, so the cache is restored from .tcache/triton.tar.xz (carry `.tcache`, which git ignores)
#   and `tcache_save "$OUT"` packs it back for the next call to carry (copy it into .tcache here).
# Triton records cache entries by absolute path, so the cache always lives at /tmp/qerl-triton-cache.
mkdir -p /tmp/qp && ln -sfn "$PWD/kernels" /tmp/qp/qerl_kernels
export PYTHONPATH=/tmp/qp:. PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/qerl-triton-cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f .tcache/triton.tar.xz ]; then
  tar -C / -xJf .tcache/triton.tar.xz && echo "triton cache: restored $(find "$TRITON_CACHE_DIR" -name '*.json' | wc -l) files"
fi

tcache_save() {  # tcache_save DIR: DIR/triton.tar.xz, under the 16 MiB a returned file may take
  local f="$1/triton.tar.xz"
  tar -C / -cf - "${TRITON_CACHE_DIR#/}" | xz -T0 -6 > "$f"
  if [ "$(stat -c %s "$f")" -gt 16000000 ]; then  # IR stages are optional on a cache hit; cubins are not
    tar -C / -cf - --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.source' \
      "${TRITON_CACHE_DIR#/}" | xz -T0 -9 > "$f"
  fi
  ls -l "$f"
}
