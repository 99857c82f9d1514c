#!/bin/sh
# Make a throwaway CA, a server certificate and a client certificate for
# broker_config/tls/nats-server-tls.conf. Development and tests only: the CA key sits next
# to the certificates and nothing is password-protected.
#
#   broker_config/tls/make-dev-certs.sh DIR [EXTRA_SAN]
#   eval "$(broker_config/tls/make-dev-certs.sh .rollfleet/tls)"
#
# Writes DIR/{ca,server-cert,server-key,client-cert,client-key}.pem and prints the
# ROLLFLEET_TLS_* exports the server config reads. The server certificate is valid for
# localhost, 127.0.0.1, the compose service name `nats`, and EXTRA_SAN (e.g. DNS:hub.example.com
# or IP:10.0.0.5) if given. Needs openssl >= 1.1.1.
set -eu

dir=${1:?usage: make-dev-certs.sh DIR [EXTRA_SAN]}
san="DNS:localhost,IP:127.0.0.1,DNS:nats${2:+,$2}"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
days=825

openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=rollfleet dev CA" \
    -keyout "$dir/ca-key.pem" -out "$dir/ca.pem" 2>/dev/null

# $1 = name, $2 = subject CN, $3 = extensions file contents
issue() {
    printf '%s\n' "$3" > "$dir/$1.ext"
    openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" \
        -keyout "$dir/$1-key.pem" -out "$dir/$1.csr" 2>/dev/null
    openssl x509 -req -in "$dir/$1.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" \
        -CAcreateserial -days "$days" -extfile "$dir/$1.ext" -out "$dir/$1-cert.pem" 2>/dev/null
    rm -f "$dir/$1.csr" "$dir/$1.ext"
}

issue server "rollfleet nats" "subjectAltName=$san
extendedKeyUsage=serverAuth"
issue client "rollfleet client" "extendedKeyUsage=clientAuth"
chmod 600 "$dir"/*-key.pem

echo "export ROLLFLEET_TLS_CA='$dir/ca.pem'"
echo "export ROLLFLEET_TLS_CERT='$dir/server-cert.pem'"
echo "export ROLLFLEET_TLS_KEY='$dir/server-key.pem'"
