#!/usr/bin/env bash
# The Debian libraries Mooncake's transfer engine loads, even over TCP: libibverbs1,
# librdmacm1, libnuma1. Installs the missing ones as root (apt-get); otherwise prints the
# command to run. Never fails: the engine runs without them, only PD disaggregation needs them.
set -u
. "$(dirname "$0")/apt_missing.sh"

[ "$(uname -s)" = Linux ] || { echo "system deps: not Linux, nothing to check"; exit 0; }

# soname:package
LIBS="libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1"

have_lib() {
    local ldconfig
    ldconfig=$(command -v ldconfig || echo /sbin/ldconfig)
    if [ -x "$ldconfig" ]; then
        "$ldconfig" -p 2>/dev/null | grep -q "^[[:space:]]*$1 "
    else
        dpkg-query -W -f='${Status}' "$2" 2>/dev/null | grep -q "install ok installed"
    fi
}

missing=""
for entry in $LIBS; do
    have_lib "${entry%%:*}" "${entry##*:}" || missing="$missing ${entry##*:}"
done
missing=${missing# }
[ -z "$missing" ] && { echo "system deps: libibverbs1 librdmacm1 libnuma1 present"; exit 0; }

install_missing "system deps" "$missing" "only PD disaggregation (Mooncake) needs them"
exit 0
