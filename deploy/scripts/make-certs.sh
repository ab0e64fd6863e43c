#!/bin/sh
# Make the certificates for mTLS between workers: a CA, and one certificate per worker role
# signed by it (both serverAuth and clientAuth, so a role can also be a client, e.g. the
# prefill container's own health check).
#
#   deploy/scripts/make-certs.sh DIR [DAYS]       # DIR gets ca.pem, prefill.pem, prefill-key.pem,
#                                                 # decode.pem, decode-key.pem (keys 0600)
#
# The certificates name their role (DNS:prefill, DNS:decode) plus localhost and 127.0.0.1;
# decode workers dial prefill workers by IP and check the name with --tls-server-name prefill.
# The CA key is deleted once both certificates are signed (set KEEP_CA_KEY=1 to keep it as
# DIR/ca-key.pem and sign more later). Compose runs this itself with SCD_MTLS=1; for
# Kubernetes: make-certs.sh DIR && kubectl create secret generic scd-serve-tls --from-file=DIR
set -eu

DIR="${1:?usage: make-certs.sh DIR [DAYS]}"
DAYS="${2:-825}"
command -v openssl >/dev/null || { echo "make-certs.sh: openssl not found" >&2; exit 1; }
mkdir -p "$DIR"
umask 077
KEY="-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes"

# shellcheck disable=SC2086  # $KEY is several options on purpose
openssl req -x509 $KEY -keyout "$DIR/ca-key.pem" -out "$DIR/ca.pem" -days "$DAYS" \
    -subj "/CN=scd-serve cluster CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
for role in prefill decode; do
    # shellcheck disable=SC2086
    openssl req $KEY -keyout "$DIR/$role-key.pem" -out "$DIR/$role.csr" -subj "/CN=$role" 2>/dev/null
    printf '%s\n' "basicConstraints=CA:FALSE" "keyUsage=critical,digitalSignature" \
        "extendedKeyUsage=serverAuth,clientAuth" "subjectAltName=DNS:$role,DNS:localhost,IP:127.0.0.1" \
        >"$DIR/$role.ext"
    openssl x509 -req -in "$DIR/$role.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca-key.pem" -CAcreateserial \
        -CAserial "$DIR/ca.srl" -out "$DIR/$role.pem" -days "$DAYS" -extfile "$DIR/$role.ext" 2>/dev/null
    rm -f "$DIR/$role.csr" "$DIR/$role.ext"
done
rm -f "$DIR/ca.srl"
[ "${KEEP_CA_KEY:-}" = "1" ] || rm -f "$DIR/ca-key.pem"
chmod 0644 "$DIR/ca.pem" "$DIR/prefill.pem" "$DIR/decode.pem"
echo "make-certs.sh: CA and prefill/decode certificates in $DIR (valid $DAYS days)"
