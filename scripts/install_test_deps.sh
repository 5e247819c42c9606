#!/usr/bin/env bash
# What the test suite needs beyond the venv: the aarch64 cross tools that build the CPU
# kernels for ARM and run them under emulation (tests/arm: Debian's gcc-aarch64-linux-gnu
# with its libc, and qemu-user-static). Installs the missing ones as root (apt-get);
# otherwise prints the command to run. Never fails: without them the ARM tests skip, saying
# why. On an aarch64 host the kernels build natively and nothing is needed.
set -u
. "$(dirname "$0")/apt_missing.sh"

[ "$(uname -s)" = Linux ] || { echo "test deps: not Linux, nothing to check"; exit 0; }
case "$(uname -m)" in
    aarch64 | arm64) echo "test deps: an aarch64 host builds its kernels natively"; exit 0 ;;
esac

# command:package
TOOLS="aarch64-linux-gnu-gcc:gcc-aarch64-linux-gnu qemu-aarch64-static:qemu-user-static"
missing=""
for entry in $TOOLS; do
    command -v "${entry%%:*}" >/dev/null || missing="$missing ${entry##*:}"
done
# the static C library the harness links against (the cross gcc alone does not pull it in)
[ -e /usr/aarch64-linux-gnu/lib/libc.a ] || missing="$missing libc6-dev-arm64-cross"
missing=${missing# }
[ -z "$missing" ] && { echo "test deps: aarch64 cross gcc and qemu-user-static present"; exit 0; }

install_missing "test deps" "$missing" "the ARM kernel tests skip without them"
exit 0
