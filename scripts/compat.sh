#!/usr/bin/env bash
# Runs the README's test command (or any command) on another Debian release,
# in a root of its own: bookworm (libtorch 1.13, gcc 12), trixie (2.6, gcc 14)
# or sid (2.14, gcc 16).
#
#   bash scripts/compat.sh sid                  # setup, build and the whole suite there
#   bash scripts/compat.sh sid bash scripts/build.sh dtrain   # any command, in the tree's copy
#   bash scripts/compat.sh sid --shell          # a shell in the root's copy of the tree
#
# Needs root (mmdebstrap, mount, chroot). The root is made once, with
# mmdebstrap, under DTRAIN_COMPAT_ROOTS (default /var/cache/dtrain-compat),
# and kept: a later run reuses its packages, its build folder and its ccache.
# This working tree (tracked and untracked files that git does not ignore) is
# copied to /src/dtrain inside the root before each run.
#
# The root gets what the suite needs from a machine: itself bind-mounted onto
# itself (so that tests may make / private in a mount namespace), /proc, /dev,
# /dev/pts, /dev/shm, and /sys recursively (slurmd reads /sys/fs/cgroup).
# Everything is unmounted again when the command ends, however it ends.
set -euo pipefail
cd "$(dirname "$0")/.."

release=${1:-}
case "$release" in
  bookworm|trixie|sid) shift ;;
  *) echo "usage: scripts/compat.sh bookworm|trixie|sid [--shell | command...]" >&2; exit 2 ;;
esac
if [ "$(id -u)" -ne 0 ]; then
  echo "compat: needs root (mmdebstrap, mount and chroot)" >&2
  exit 2
fi
roots=${DTRAIN_COMPAT_ROOTS:-/var/cache/dtrain-compat}
root="$roots/$release"
mkdir -p "$roots"

# One run per root at a time: a second waits for the first.
exec 9>"$roots/$release.lock"
flock 9

if [ ! -x "$root/usr/bin/apt-get" ]; then
  bash scripts/setup.sh only mmdebstrap
  echo "compat: making a $release root in $root (mmdebstrap, about 2 minutes)"
  partial="$root.partial"
  if findmnt -rn -o TARGET | grep -q "^$partial"; then
    echo "compat: $partial still has mounts; unmount them first" >&2
    exit 1
  fi
  rm -rf --one-file-system "$partial"
  # Mirrors that serve a frozen snapshot have Release files past their
  # Valid-Until date; the root is for tests, so apt accepts them there.
  mmdebstrap --variant=apt --aptopt='Acquire::Check-Valid-Until "false"' \
    --include=git,ca-certificates "$release" "$partial"
  mv "$partial" "$root"
fi

mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount -R "${mounts[$i]}" 2>/dev/null || umount -lR "${mounts[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
mount --bind "$root" "$root" && mount --make-private "$root" && mounts+=("$root")
mount -t proc proc "$root/proc" && mounts+=("$root/proc")
mount --bind /dev "$root/dev" && mounts+=("$root/dev")
mount --bind /dev/pts "$root/dev/pts" && mounts+=("$root/dev/pts")
mount --bind /dev/shm "$root/dev/shm" && mounts+=("$root/dev/shm")
# rslave: unmounting the copy never reaches the host's /sys.
mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys" && mounts+=("$root/sys")
cp /etc/resolv.conf /etc/hosts "$root/etc/"

echo "compat: copying this tree to $root/src/dtrain"
mkdir -p "$root/src/dtrain"
# The tree's files replace the copy's; the copy's build/ stays for the next
# run. Only files whose content changed are written, and they get this
# moment as their time: tar alone would restore the tree's times, which may
# be older than an object that an earlier run built from the old content,
# and make would then keep that stale object.
stage="$root/src/.incoming"
rm -rf --one-file-system "$stage"
mkdir -p "$stage"
git ls-files -z --cached --others --exclude-standard |
  tar --null -T - -cf - | tar -xf - -C "$stage"
(cd "$stage" && find . -type f -print0) | while IFS= read -r -d '' f; do
  dst="$root/src/dtrain/$f"
  cmp -s "$stage/$f" "$dst" 2>/dev/null && continue
  mkdir -p "$(dirname "$dst")"
  cp "$stage/$f" "$dst"
done
rm -rf --one-file-system "$stage"

inner=(bash scripts/test.sh)
if [ "${1:-}" = "--shell" ]; then
  inner=(bash -l)
elif [ $# -gt 0 ]; then
  inner=("$@")
fi
pass=()
for v in $(compgen -e); do
  case "$v" in DTRAIN_*|CTEST_*|GTEST_*) pass+=("$v=${!v}") ;; esac
done
echo "compat: running ${inner[*]} in $release"
# 9>&-: the lock stays with this script; a daemon a test leaves behind must
# not hold it for the next run.
chroot "$root" /usr/bin/env -i HOME=/root TERM="${TERM:-dumb}" LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${pass[@]}" \
  bash -c 'cd /src/dtrain && exec "$@"' compat "${inner[@]}" 9>&-
