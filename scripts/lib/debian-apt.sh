# shellcheck shell=bash
# Sourced by the install scripts: a private apt configuration pointed at the Debian mirror named in the
# system's own apt sources (the project never names a host), trusting only Debian's archive keyring.
# Nothing of the system's apt state (package database, lists, cache, locks) is read or changed.
#
# The caller defines `log MESSAGE` and `die MESSAGE` (prints and exits) and then calls
#   debian_apt_init APTDIR "deb SUITE..." ["deb-src SUITE..."]
# which creates APTDIR's folders, writes its sources list (one line per type and suite, `main` only),
# sets MIRROR, KEYRING and APT_OPTS (an array: pass "${APT_OPTS[@]}" to apt-get and apt-cache) and
# fetches the indexes (`apt-get update`; their Release files' signatures are checked against KEYRING).
#   GPU_CHECKPOINT_DEBIAN_MIRROR  Debian mirror URI to use (default: the first Debian URI of the system's apt sources)
#   GPU_CHECKPOINT_APT_KEYRING    keyring that signs the suites' Release files (default: the system's debian-archive-keyring)

# The Debian URIs of the system's apt sources, one a line (deb822 files first, then one-line files).
debian_apt_find_mirrors() {
    local f
    # deb822 files: a stanza with `Types: deb` and a `Suites:` line without -security/-updates suites.
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -r "$f" ] || continue
        awk '
            function flush() {
                if (types ~ /(^|[ \t])deb([ \t]|$)/ && uris != "" && suites !~ /-security/) { split(uris, u, /[ \t]+/); print u[1]; found = 1; exit }
                types = ""; uris = ""; suites = ""
            }
            /^[ \t]*#/ { next }
            /^[ \t]*$/ { flush(); next }
            tolower($1) == "types:"  { $1 = ""; types = $0 }
            tolower($1) == "uris:"   { $1 = ""; sub(/^[ \t]+/, ""); uris = $0 }
            tolower($1) == "suites:" { $1 = ""; suites = $0 }
            END { if (!found) flush() }
        ' "$f"
    done
    # One-line style: `deb [options] URI suite components`.
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -r "$f" ] || continue
        awk '$1 == "deb" {
                i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) !~ /-security/) print $i
            }' "$f"
    done
}

# Sets MIRROR: $GPU_CHECKPOINT_DEBIAN_MIRROR, else a URI of the system's sources that looks like the main
# Debian archive (".../debian"), else the first one found.
debian_apt_mirror() {
    local mirrors
    MIRROR=${GPU_CHECKPOINT_DEBIAN_MIRROR:-}
    if [ -z "$MIRROR" ]; then
        mirrors=$(debian_apt_find_mirrors)
        MIRROR=$(printf '%s\n' "$mirrors" | grep -E '/debian/?$' | head -1 || true)
        [ -n "$MIRROR" ] || MIRROR=$(printf '%s\n' "$mirrors" | head -1)
    fi
    [ -n "$MIRROR" ] || die "no Debian mirror found in /etc/apt/sources.list{,.d}; set GPU_CHECKPOINT_DEBIAN_MIRROR"
}

# Sets KEYRING: the suites' Release files are signed by keys in Debian's archive keyring. We never fall
# back to an unsigned download: what we fetch is built and run as root, next to every process we
# checkpoint. A system without the keyring can install `debian-archive-keyring` or point
# GPU_CHECKPOINT_APT_KEYRING at a keyring that holds the suites' signing keys.
debian_apt_keyring() {
    local k
    KEYRING=${GPU_CHECKPOINT_APT_KEYRING:-}
    if [ -z "$KEYRING" ]; then
        for k in /usr/share/keyrings/debian-archive-keyring.gpg /usr/share/keyrings/debian-archive-trixie-stable.gpg; do
            [ -r "$k" ] && KEYRING=$k && break
        done
    fi
    [ -n "$KEYRING" ] && [ -r "$KEYRING" ] ||
        die "no Debian archive keyring found (install debian-archive-keyring or set GPU_CHECKPOINT_APT_KEYRING)"
}

# debian_apt_init APTDIR "TYPE SUITE..."...: the private apt in APTDIR, updated (see the top of this file).
debian_apt_init() {
    local aptdir=$1 spec type suites suite
    shift
    command -v apt-get >/dev/null && command -v dpkg >/dev/null ||
        die "apt-get and dpkg are needed (a Debian-like system)"
    debian_apt_mirror
    debian_apt_keyring
    mkdir -p "$aptdir"/{state/lists/partial,cache/archives/partial,sourceparts,preferences.d}
    : >"$aptdir/state/status" # empty package database: every dependency counts as "not installed"
    : >"$aptdir/sources.list"
    for spec in "$@"; do
        type=${spec%% *}
        suites=${spec#"$type"}
        for suite in $suites; do # word splitting wanted: a list of suites
            case $type in
            # target=Packages: only the package index, none of the extra indexes (AppStream...) the system may ask for.
            deb) echo "deb [signed-by=$KEYRING target=Packages] $MIRROR $suite main" ;;
            deb-src) echo "deb-src [signed-by=$KEYRING] $MIRROR $suite main" ;;
            *) die "debian_apt_init: unknown source type $type" ;;
            esac
        done >>"$aptdir/sources.list"
    done
    # shellcheck disable=SC2034 # used by the scripts that source this file
    APT_OPTS=(
        -o "Dir::Etc::SourceList=$aptdir/sources.list"
        -o "Dir::Etc::SourceParts=$aptdir/sourceparts"
        -o "Dir::Etc::Preferences=$aptdir/preferences"
        -o "Dir::Etc::PreferencesParts=$aptdir/preferences.d"
        -o "Dir::State=$aptdir/state"
        -o "Dir::State::status=$aptdir/state/status"
        -o "Dir::Cache=$aptdir/cache"
        # The private folders belong to root; apt's download sandbox user could not write them.
        -o "APT::Sandbox::User=root"
        # Our state is private, so the system's apt locks need not (and must not) be taken.
        -o "Debug::NoLocking=1"
        -o "APT::Get::List-Cleanup=0"
    )
    log "indexes of: $* (from $MIRROR)"
    apt-get "${APT_OPTS[@]}" -qq update >&2 || die "apt-get update failed (mirror $MIRROR; sources: $aptdir/sources.list)"
}

# debian_apt_lib_closure PACKAGE...: prints the packages and, recursively, the library packages (lib*)
# they depend on, one a line, from the private apt's indexes (after debian_apt_init). Only library
# packages are followed: the others (gcc-14-base...) carry no code a binary loads. In a group of
# alternatives only the first one is taken.
debian_apt_lib_closure() {
    local -A seen=()
    local queue=("$@") p deps d
    while [ ${#queue[@]} -gt 0 ]; do
        p=${queue[0]}
        queue=("${queue[@]:1}")
        [ -n "${seen[$p]:-}" ] && continue
        seen[$p]=1
        echo "$p"
        deps=$(apt-cache "${APT_OPTS[@]}" depends --no-recommends --no-suggests --no-conflicts --no-breaks \
            --no-replaces --no-enhances "$p" | awk '
                /^ *\|?(Pre)?Depends:/ {
                    alt = ($1 ~ /^\|/); name = $2
                    if (!skip && name !~ /^</) print name
                    skip = alt
                }') || die "apt-cache depends $p failed"
        for d in $deps; do
            case $d in lib*) [ -z "${seen[$d]:-}" ] && queue+=("$d") ;; esac
        done
    done
    return 0
}

# debian_apt_unpack NEW PACKAGE...: downloads the packages into the private apt's debs/ folder and unpacks
# them into NEW/root, NEW a fresh folder (anything there before is removed) that debian_apt_swap_in later
# puts in place; sets LOADER to the dynamic loader of the libc6 among them (an unpacked binary runs
# through it, with the unpacked libraries) and LIBDIR to its multiarch library folder.
debian_apt_unpack() {
    local new=$1 debs=$APTDIR/debs deb
    shift
    mkdir -p "$debs"
    rm -f "$debs"/*.deb
    (cd "$debs" && apt-get "${APT_OPTS[@]}" -qq download "$@" >&2) || die "apt-get download failed"
    rm -rf "$new"
    mkdir -p "$new/root" "$new/bin"
    for deb in "$debs"/*.deb; do
        dpkg-deb -x "$deb" "$new/root"
    done
    LOADER=$(find "$new/root/usr/lib" -maxdepth 2 -name 'ld-linux*.so*' -path '*-linux-gnu*/*' | head -1)
    [ -n "$LOADER" ] || die "dynamic loader missing from libc6"
    # shellcheck disable=SC2034 # used by the scripts that source this file
    LIBDIR=$(dirname "$LOADER")
}

# debian_apt_swap_in NEW PREFIX: puts the finished folder NEW in PREFIX's place (the previous PREFIX is
# removed), so that an interrupted install leaves the old prefix or the new one, never half of one.
debian_apt_swap_in() {
    rm -rf "$2.old"
    if [ -e "$2" ]; then
        mv "$2" "$2.old"
    fi
    mv "$1" "$2"
    rm -rf "$2.old"
}
