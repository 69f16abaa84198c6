# shellcheck shell=bash
# Inside the test container (Debian 12 with nginx-light, libnginx-mod-http-js, python3, openssl,
# dnsmasq-base): install the ROLE-RENDERED front from /gw/rendered, a test CA and certificate for
# cloud.test, a DNS server that answers cloud.test (nginx resolves endpoint names per request), the
# fake router replicas and the two fake cloud endpoints; then `nginx -t` and start nginx.
set -euo pipefail
cd /gw
mkdir -p /tmp/gw /etc/nginx/njs
if [ ! -f /tmp/gw/ca.pem ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=inferops-test-ca \
        -keyout /tmp/gw/ca.key -out /tmp/gw/ca.pem 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj /CN=cloud.test -keyout /tmp/gw/cloud.key \
        -out /tmp/gw/cloud.csr 2>/dev/null
    printf 'subjectAltName=DNS:cloud.test\n' > /tmp/gw/san.ext
    openssl x509 -req -in /tmp/gw/cloud.csr -CA /tmp/gw/ca.pem -CAkey /tmp/gw/ca.key \
        -CAcreateserial -days 2 -extfile /tmp/gw/san.ext -out /tmp/gw/cloud.pem 2>/dev/null
fi
install -m 0644 /tmp/gw/ca.pem /etc/nginx/inferops-test-ca.pem
r=/gw/rendered
# Where the role puts each file (roles/vllm_router/vars/main.yml), with the role's modes.
rm -f /etc/nginx/sites-enabled/default
install -m 0644 "$r/inferops-vllm.conf" /etc/nginx/sites-available/inferops-vllm.conf
ln -sf /etc/nginx/sites-available/inferops-vllm.conf /etc/nginx/sites-enabled/inferops-vllm.conf
install -m 0600 "$r/inferops-vllm-keys.map" "$r/inferops-vllm-proxy.conf" /etc/nginx/
install -m 0644 "$r/inferops-vllm-fallback-proxy.conf" /etc/nginx/
install -m 0644 "$r/inferops-vllm-fallback.js" /etc/nginx/njs/
for f in "$r"/inferops-vllm-fallback-[0-9]*.conf; do install -m 0600 -o root -g root "$f" /etc/nginx/; done
# The endpoints' per-minute request counts (the role's budget directory: nginx's workers write it).
rm -rf /var/lib/nginx/inferops-vllm-budget
install -d -m 0700 -o www-data -g www-data /var/lib/nginx/inferops-vllm-budget
# DNS for the endpoints' name (the rendered `resolver 127.0.0.1:5353`).
if [ -f /tmp/gw/dnsmasq.pid ]; then kill "$(cat /tmp/gw/dnsmasq.pid)" 2>/dev/null || true; fi
sleep 0.2
dnsmasq --port=5353 --listen-address=127.0.0.1 --bind-interfaces --no-resolv --no-hosts --local=/cloud.test/ \
        --address=/cloud.test/127.0.0.1 --pid-file=/tmp/gw/dnsmasq.pid
for f in local cloud_a cloud_b; do
    if [ -f "/tmp/gw/$f.pid" ]; then kill "$(cat "/tmp/gw/$f.pid")" 2>/dev/null || true; fi
done
sleep 0.3
echo ok > /tmp/gw/local_mode; echo ok > /tmp/gw/cloud_a_mode; echo ok > /tmp/gw/cloud_b_mode
read -r KEY_A KEY_B < /gw/cloud_keys
nohup python3 fake_local.py 18301 18302 > /tmp/gw/local.out 2>&1 & echo $! > /tmp/gw/local.pid
nohup python3 fake_cloud.py 18443 a "$KEY_A" /tmp/gw/cloud.pem /tmp/gw/cloud.key > /tmp/gw/cloud_a.out 2>&1 & echo $! > /tmp/gw/cloud_a.pid
nohup python3 fake_cloud.py 18444 b "$KEY_B" /tmp/gw/cloud.pem /tmp/gw/cloud.key > /tmp/gw/cloud_b.out 2>&1 & echo $! > /tmp/gw/cloud_b.pid
# The role's validate of the site (a minimal nginx.conf with the enabled modules), then the whole configuration.
bash /gw/validate.sh && echo "role's site validation: ok"
nginx -t
if [ -f /run/nginx.pid ] && kill -0 "$(cat /run/nginx.pid)" 2>/dev/null; then
    nginx -s quit; for _ in $(seq 50); do [ -f /run/nginx.pid ] || break; sleep 0.1; done
fi
nginx
sleep 0.5
echo "setup done"
