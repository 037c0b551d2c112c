#!/usr/bin/env bash
# The guest kit for tests/guest_nbd.rs: QEMU (the same version as the installed qemu-utils, so
# benchmarks keep their peer), busybox-static, and Debian's amd64 kernel with its modules
# extracted (not installed) under $STRATA_GUEST_KIT, with a modules.dep from busybox depmod.
# Idempotent; prints the kit's directory. Everything comes from Debian's archive.
set -euo pipefail
kit="${STRATA_GUEST_KIT:-/var/cache/strata-guest}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo

if ! command -v qemu-system-x86_64 >/dev/null 2>&1 || ! command -v busybox >/dev/null 2>&1; then
  want=$(dpkg-query -W -f='${Version}' qemu-utils 2>/dev/null || true)
  # A backported qemu-utils (…~bpo12…) needs qemu-system-x86 from the same suite: from the
  # default suite apt would replace qemu-utils with an older version.
  if [[ "$want" == *bpo12* ]] && ! apt-cache policy qemu-system-x86 | grep -q bookworm-backports; then
    printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' |
      $SUDO tee /etc/apt/sources.list.d/strata-bookworm-backports.sources >/dev/null
  fi
  $SUDO apt-get update -qq
  pkgs=(busybox-static) opts=()
  if [ -n "$want" ]; then pkgs+=("qemu-system-x86=$want"); else pkgs+=(qemu-system-x86); fi
  # Its dependencies (qemu-system-common, -data, seabios) must come from that suite as well.
  [[ "$want" == *bpo12* ]] && opts+=(-t bookworm-backports)
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${opts[@]}" "${pkgs[@]}" >/dev/null
fi

if ! ls "$kit"/root/lib/modules/*/modules.dep >/dev/null 2>&1; then
  $SUDO mkdir -p "$kit"
  tmp=$(mktemp -d)
  # linux-image-amd64 depends on the current linux-image-<abi>-amd64.
  image=$(apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
  [ -n "$image" ] || { echo "guest-kit: cannot resolve linux-image-amd64" >&2; exit 1; }
  (cd "$tmp" && apt-get download "$image" 2>/dev/null)
  $SUDO dpkg -x "$tmp"/"$image"_*.deb "$kit/root"
  rm -rf "$tmp"
  version=$(ls "$kit/root/lib/modules" | head -1)
  $SUDO busybox depmod -b "$kit/root" "$version"
fi
echo "$kit"
