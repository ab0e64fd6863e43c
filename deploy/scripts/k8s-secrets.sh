#!/bin/sh
# Create the Secrets the Kubernetes manifests read, with fresh random values (once; an
# existing Secret is left as it is, so rerunning never rotates anything by accident).
#
#   deploy/scripts/k8s-secrets.sh [--mtls] [-n NAMESPACE]
#
# scd-serve-secrets: cluster-secret (signs control-plane messages), api-key (clients ->
#   gateway -> decode), worker-token (decode -> prefill). Read the API key with
#   kubectl get secret scd-serve-secrets -o jsonpath='{.data.api-key}' | base64 -d
# scd-serve-tls (--mtls, for deploy/k8s-mtls): a CA and the prefill/decode certificates
#   from make-certs.sh; the CA key is not kept.
# Bring your own values instead with `kubectl create secret generic scd-serve-secrets
# --from-literal=cluster-secret=... --from-literal=api-key=... --from-literal=worker-token=...`.
set -eu

HERE="$(cd "$(dirname "$0")" && pwd)"
MTLS=0
NS=""
while [ $# -gt 0 ]; do
    case "$1" in
        --mtls) MTLS=1 ;;
        -n|--namespace) NS="--namespace=${2:?-n needs a namespace}"; shift ;;
        *) echo "usage: k8s-secrets.sh [--mtls] [-n NAMESPACE]" >&2; exit 2 ;;
    esac
    shift
done
command -v kubectl >/dev/null || { echo "k8s-secrets.sh: kubectl not found" >&2; exit 1; }
command -v openssl >/dev/null || { echo "k8s-secrets.sh: openssl not found" >&2; exit 1; }

exists() { kubectl get secret $NS "$1" >/dev/null 2>&1; }

if exists scd-serve-secrets; then
    echo "k8s-secrets.sh: secret scd-serve-secrets exists; left as it is"
else
    kubectl create secret generic $NS scd-serve-secrets \
        --from-literal=cluster-secret="$(openssl rand -hex 32)" \
        --from-literal=api-key="$(openssl rand -hex 32)" \
        --from-literal=worker-token="$(openssl rand -hex 32)" >/dev/null
    echo "k8s-secrets.sh: created secret scd-serve-secrets"
fi

if [ "$MTLS" = 1 ]; then
    if exists scd-serve-tls; then
        echo "k8s-secrets.sh: secret scd-serve-tls exists; left as it is"
    else
        dir="$(mktemp -d)"
        trap 'rm -rf "$dir"' EXIT
        sh "$HERE/make-certs.sh" "$dir" >/dev/null
        kubectl create secret generic $NS scd-serve-tls --from-file="$dir" >/dev/null
        echo "k8s-secrets.sh: created secret scd-serve-tls"
    fi
fi
