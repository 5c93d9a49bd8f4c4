# shellcheck shell=bash
# Sourced by the setup scripts: installs Debian packages from the system's own apt sources, only those
# whose program is missing. Packages installed here never start as services: a policy-rc.d forbids it for
# the install (one already there is left alone), and where systemd runs, the units named in
# APT_MISSING_SERVICES are disabled as well (`PACKAGE` for a unit of the package's name, `PACKAGE:UNIT`
# otherwise).
#
#   apt_install_missing PROGRAM:PACKAGE...
# installs PACKAGE where PROGRAM is neither on PATH nor in /usr/sbin. Returns 1 (with a message) when
# something was missing and could not be installed. The package lists are fetched only when the install
# cannot do without them.
apt_install_missing() {
    local want=() pair bin pkg
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
    local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=600)
    local ok=1
    # Another apt (a second setup run) may hold the lock: wait for it rather than fail.
    if ! "${apt[@]}" "${want[@]}" >/dev/null; then
        apt-get update -q -o DPkg::Lock::Timeout=600 >/dev/null && "${apt[@]}" "${want[@]}" >/dev/null || ok=
    fi
    if [ -n "$ours" ]; then
        rm -f "$policy"
    fi
    if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
        local p s
        for p in "${want[@]}"; do
            for s in ${APT_MISSING_SERVICES:-}; do
                if [ "${s%%:*}" = "$p" ]; then
                    systemctl disable --now "${s#*:}" >/dev/null 2>&1 || true
                fi
            done
        done
    fi
    [ -n "$ok" ] || { echo "setup: installing ${want[*]} failed" >&2; return 1; }
}
