#!/bin/sh
# Build gpuhook-relay (or gpuhook-runtime, the runc wrapper's front-end), statically linked:
#   relay/build.sh OUT_PATH [gpuhook-relay|gpuhook-runtime]
# The version it sends must be gpuhook's own (gpuhookd declines any other), so it is read from
# gpuhook/__init__.py here rather than written down twice.
set -eu
program=${2:-gpuhook-relay}
if [ "$#" -lt 1 ] || [ "$#" -gt 2 ] || { [ "$program" != gpuhook-relay ] && [ "$program" != gpuhook-runtime ]; }; then
    echo "usage: $0 OUT_PATH [gpuhook-relay|gpuhook-runtime]" >&2
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
init="$here/../gpuhook/__init__.py"
version=$(sed -n 's/^__version__ = "\([0-9A-Za-z.+-]*\)"$/\1/p' "$init")
if [ -z "$version" ] || [ "$(printf '%s\n' "$version" | wc -l)" -ne 1 ]; then
    echo "$0: no single __version__ = \"X\" line in $init" >&2
    exit 1
fi
cc=${CC:-gcc}
hardening="-fstack-protector-strong -fstack-clash-protection"
case "$($cc -dumpmachine)" in
    x86_64-* | i?86-*) hardening="$hardening -fcf-protection" ;;  # CET: an x86 option only
esac
# RELAY_DEFINES: -D options tests build a copy with (the default paths compiled in, moved to a temporary directory).
# shellcheck disable=SC2086  # $hardening, $RELAY_DEFINES: several words
$cc -static -O2 -std=c11 -D_GNU_SOURCE -D_FORTIFY_SOURCE=2 -DGPUHOOK_VERSION="\"$version\"" ${RELAY_DEFINES:-} \
    -Wall -Wextra -Werror -Wshadow -Wformat=2 -Wconversion -Wno-sign-conversion \
    $hardening \
    -Wl,-z,relro,-z,now,-z,noexecstack \
    -o "$1" "$here/$program.c"
# binutils comes with gcc; `file` may not be installed.
if ! LC_ALL=C readelf -d "$1" | grep -q "There is no dynamic section"; then
    echo "$0: $1 is not statically linked" >&2
    exit 1
fi
