# shellcheck shell=bash
# Sourced by the install scripts that fill a prefix of the project's own (.deps/NAME) from Debian packages
# (scripts/install-criu.sh, install-checkpointctl.sh, install-containerd.sh): their
# messages, the early exit of a second run, and the last steps of a first one.
#
# The caller sets NAME (its messages start with `install-NAME: `), and for prefix_reuse and prefix_finish
# also PREFIX, STAMP (what the prefix is installed from; a prefix whose `installed-from` file says otherwise
# is installed again) and REINSTALL (1: install again anyway), or has prefix_init set them; and it defines
# `works DIR` (true when DIR holds a working install) and `describe DIR` (what DIR holds, for the messages).

log() { echo "install-$NAME: $*" >&2; }
die() {
    log "error: $*"
    exit 1
}

# prefix_init NAME PREFIX SUITE REINSTALL: sets NAME, PREFIX (REPO/.deps/NAME when empty), SUITE (the
# Debian suite the packages come from), STAMP ("suite: SUITE") and REINSTALL.
prefix_init() {
    NAME=$1
    PREFIX=${2:-$REPO/.deps/$1}
    SUITE=$3
    STAMP="suite: $SUITE"
    REINSTALL=$4
}

# prefix_reuse RESULT: unless REINSTALL is 1, when PREFIX works and was installed from STAMP, says so,
# prints RESULT (the script's last line) and exits.
prefix_reuse() {
    if [ "${REINSTALL:-0}" != 1 ] && works "$PREFIX" &&
        [ "$(cat "$PREFIX/installed-from" 2>/dev/null)" = "$STAMP" ]; then
        log "$(describe "$PREFIX") already installed in $PREFIX"
        echo "$1"
        exit 0
    fi
}

# prefix_finish NEW RESULT: records STAMP in the finished folder NEW, puts it in PREFIX's place
# (debian_apt_swap_in), drops the downloaded packages (the index stays for a quick reinstall), says what
# was installed and prints RESULT.
prefix_finish() {
    echo "$STAMP" >"$1/installed-from"
    debian_apt_swap_in "$1" "$PREFIX"
    rm -f "$APTDIR"/debs/*.deb
    log "$(describe "$PREFIX") installed in $PREFIX"
    echo "$2"
}
