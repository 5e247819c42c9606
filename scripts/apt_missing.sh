# Sourced by scripts/install_*_deps.sh: install_missing LABEL PACKAGES WITHOUT installs the
# Debian PACKAGES (space separated) as root with apt-get, updating the package lists once if
# the first try fails (a fresh container has none); elsewhere it prints the command to run.
# WITHOUT says what goes without them. Never fails.
install_missing() {
    local label=$1 missing=$2 without=$3
    local install="env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing"
    if ! command -v apt-get >/dev/null; then
        echo "$label: missing $missing (Debian names); $without" >&2
    elif [ "$(id -u)" -eq 0 ]; then
        echo "$label: installing $missing"
        $install >/dev/null || { apt-get update -q >/dev/null && $install >/dev/null; } \
            || echo "$label: could not install $missing; $without" >&2
    else
        echo "$label: missing $missing ($without); run:" >&2
        echo "  sudo apt-get install -y --no-install-recommends $missing" >&2
    fi
}
