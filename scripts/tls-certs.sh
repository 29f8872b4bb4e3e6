#!/usr/bin/env bash
# Makes x509 credentials for NBD over TLS with openssl, in the layout of QEMU's
# tls-creds-x509 directory (what spoold's [tls] dir, qemu-img's tls-creds-x509 object and
# libnbd's tls-certificates= read): DIR/ca-cert.pem and ca-key.pem (a new CA), server-cert.pem
# and server-key.pem (for the HOSTs given: IP addresses or DNS names; default 127.0.0.1 and
# localhost), client-cert.pem and client-key.pem. For tests and trials: a production CA
# keeps its key elsewhere, and each side gets only its own files (the server: ca-cert.pem,
# server-*.pem; a client: ca-cert.pem, client-*.pem).
#   scripts/tls-certs.sh DIR [HOST...]
set -euo pipefail
dir=${1:?usage: tls-certs.sh DIR [HOST...]}
shift
hosts=("$@")
((${#hosts[@]})) || hosts=(127.0.0.1 localhost)
san=""
for h in "${hosts[@]}"; do
    if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
done
mkdir -p "$dir"
cd "$dir"
umask 077
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/CN=spool test CA $RANDOM" \
    -keyout ca-key.pem -out ca-cert.pem 2>/dev/null
make() {
    local who=$1 ext=$2
    printf '%s\n' "$ext" > "$who.ext"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$who" -keyout "$who-key.pem" \
        -out "$who.csr" 2>/dev/null
    openssl x509 -req -in "$who.csr" -CA ca-cert.pem -CAkey ca-key.pem -CAcreateserial \
        -days 365 -extfile "$who.ext" -out "$who-cert.pem" 2>/dev/null
    rm -f "$who.csr" "$who.ext"
}
make server "$(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth' "${san%,}")"
make client "$(printf 'subjectAltName=DNS:spool-client\nextendedKeyUsage=clientAuth')"
chmod 644 ca-cert.pem server-cert.pem client-cert.pem
echo "credentials in $dir (CA, server for ${hosts[*]}, client)"
