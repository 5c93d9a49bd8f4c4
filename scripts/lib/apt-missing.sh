# shellcheck shell=bash
# Sourced by scripts/setup.sh and the install scripts: `apt_install_missing BIN:PACKAGE...` installs, from
# the distribution's packages, the packages whose program BIN is missing (a no-op when every one is there).
# Packages apt installs here never start as services: a policy-rc.d forbids it for the install (one already
# there is left alone), and where systemd runs, the units of the packages named in APT_NO_SERVICE (blank
# separated) are disabled as well. Returns 1 (and says why) when something could not be installed.
apt_install_missing() {
    local want=() pair pkg bin
    for pair in "$@"; do
        bin=${pair%%:*} pkg=${pair#*:}
        if ! command -v "$bin" >/dev/null && [ ! -x "/usr/sbin/$bin" ] && [ ! -x "/usr/bin/$bin" ]; then
            want+=("$pkg")
        fi
    done
    [ ${#want[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "setup: cannot install ${want[*]} (needs root and apt-get)" >&2
        return 1
    fi
    local policy=/usr/sbin/policy-rc.d ours=
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        ours=1
    fi
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends)
    local ok=1
    # The package lists are fetched only when the install cannot do without them.
    if ! "${apt[@]}" "${want[@]}" >/dev/null 2>&1; then
        apt-get update -q >/dev/null && "${apt[@]}" "${want[@]}" >/dev/null || ok=
    fi
    if [ -n "$ours" ]; then
        rm -f "$policy"
    fi
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
        local p s
        for p in "${want[@]}"; do
            for s in ${APT_NO_SERVICE:-}; do
                [ "$p" = "$s" ] && { systemctl disable --now "$p" >/dev/null 2>&1 || true; }
            done
        done
    fi
    [ -n "$ok" ] || { echo "setup: installing ${want[*]} failed" >&2; return 1; }
}
