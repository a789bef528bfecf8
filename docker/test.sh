#!/usr/bin/env bash
# Build docker/Dockerfile on a local CPU base with podman, run it with the embedded SmolLM2
# model and check the HTTP surface. Exit code 0 only if every check passed; the container is
# removed in every case. Images are kept (and reused by tag) to make the next run fast.
#
#   docker/test.sh            (make docker-test)
#
# Environment knobs:
#   MG_DOCKER_WORK      scratch folder (containers.conf, rootfs tarball)   [/tmp/mg-docker]
#   MG_DOCKER_IMAGE     tag of the image under test                       [localhost/mg-server:test]
#   MG_DOCKER_PORT      host port (bound to 127.0.0.1) for the container  [30080]
#   MG_HEALTH_TIMEOUT   seconds to wait for /health                       [300]
#   MG_DOCKER_NO_BUILD  1: test the existing MG_DOCKER_IMAGE without rebuilding
#   MG_SERVE_ARGS       extra arguments for `mg-server serve` in the container
#   MG_DOCKER_PRUNE     0: keep dangling images of earlier builds           [1]
#
# Why podman: there is no Docker engine here; Debian's podman + runc build and run OCI images.
# No registry is reachable either, so the base is a Debian bookworm rootfs (mmdebstrap from the
# machine's apt mirror) plus torch 2.13.0 CPU: docker/cpu-base.Dockerfile.
# ok/fail always succeed, so "A && ok || fail" is a safe if-then-else here.
# shellcheck disable=SC2015
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

WORK=${MG_DOCKER_WORK:-/tmp/mg-docker}
IMAGE=${MG_DOCKER_IMAGE:-localhost/mg-server:test}
PORT=${MG_DOCKER_PORT:-30080}
HEALTH_TIMEOUT=${MG_HEALTH_TIMEOUT:-300}
CONTAINER=mg-docker-test-$$
SUITE=bookworm
ROOTFS_PACKAGES=python3,python3-venv,ca-certificates,curl,passwd,libnuma1,libgomp1,procps
BASE_URL=http://127.0.0.1:${PORT}

mkdir -p "$WORK"
export CONTAINERS_CONF=$WORK/containers.conf
TMP=$(mktemp -d)

# ---------------------------------------------------------------- timing and reporting
T0=$(date +%s.%N)
PHASE_NAMES=()
PHASE_SECS=()
PHASE_START=
PHASE_NAME=
phase() {  # phase NAME: close the running phase, open the next
    local now
    now=$(date +%s.%N)
    if [[ -n $PHASE_NAME ]]; then
        PHASE_NAMES+=("$PHASE_NAME")
        PHASE_SECS+=("$(awk -v a="$PHASE_START" -v b="$now" 'BEGIN{printf "%.1f", b-a}')")
    fi
    PHASE_NAME=$1
    PHASE_START=$now
    [[ -n $1 ]] && echo "==> $1"
    return 0
}
summary() {
    phase ""
    echo "---- docker/test.sh timings"
    local i
    for i in "${!PHASE_NAMES[@]}"; do
        printf '  %-36s %7ss\n' "${PHASE_NAMES[$i]}" "${PHASE_SECS[$i]}"
    done
    printf '  %-36s %7ss\n' total "$(awk -v a="$T0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')"
}

FAILED=0
fail() { echo "FAIL: $*" >&2; FAILED=1; }
ok() { echo "  ok: $*"; }

cleanup() {
    local rc=$?
    if podman container exists "$CONTAINER" 2>/dev/null; then
        if [[ $rc -ne 0 || $FAILED -ne 0 ]]; then
            echo "---- last container log lines"
            podman logs --tail 60 "$CONTAINER" 2>&1 || true
        fi
        podman rm -f -t 5 "$CONTAINER" > /dev/null 2>&1 || true
        if podman container exists "$CONTAINER" 2>/dev/null; then
            echo "WARNING: container $CONTAINER not removed" >&2
        else
            echo "container $CONTAINER removed"
        fi
    fi
    rm -rf "$TMP"
    summary
    if [[ $rc -eq 0 && $FAILED -ne 0 ]]; then rc=1; fi
    [[ $rc -eq 0 ]] && echo "docker/test.sh: PASS" || echo "docker/test.sh: FAIL (rc=$rc)"
    exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ---------------------------------------------------------------- tools
phase "tools (podman, runc, mmdebstrap)"
missing=()
for tool in podman runc mmdebstrap curl; do
    command -v "$tool" > /dev/null || missing+=("$tool")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "missing ${missing[*]}; install as root: apt-get install podman runc mmdebstrap uidmap curl" >&2
        exit 2
    fi
    echo "installing ${missing[*]} with apt"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman runc mmdebstrap uidmap slirp4netns fuse-overlayfs containernetworking-plugins \
        iptables curl ca-certificates > /dev/null
fi
# runc: crun fails here ("cgroups in hybrid mode not supported"); ulimits within the hard limits.
cat > "$CONTAINERS_CONF" <<'EOF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
EOF
podman --version

hash_of() { cat "$@" | sha256sum | cut -c1-12; }

# ---------------------------------------------------------------- local base images
APT_SOURCES=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    [[ -f $f && -s $f ]] || continue
    grep -q -E 'deb\.debian\.org|debian' "$f" || continue
    APT_SOURCES+=("$f")
done
ROOTFS_TAG=localhost/mg-bookworm-rootfs:$( { echo "$SUITE $ROOTFS_PACKAGES"; cat "${APT_SOURCES[@]}" 2>/dev/null; } | sha256sum | cut -c1-12)
CA_FILES=(/usr/local/share/ca-certificates/*.crt)
TORCH_WHEELS=(/opt/wheels/torch-2.13.0+cpu-*.whl)
BASE_TAG=localhost/mg-cpu-base:$( { hash_of docker/cpu-base.Dockerfile; echo "$ROOTFS_TAG"; \
    [[ -e ${CA_FILES[0]} ]] && cat "${CA_FILES[@]}"; ls "${TORCH_WHEELS[@]}" 2>/dev/null; } | sha256sum | cut -c1-12)

# The host's local package folders, visible to pip inside builds exactly as on the host.
BUILD_MOUNTS=()
for d in /opt/wheels /opt/pypi /opt/pypi-more; do
    [[ -d $d ]] && BUILD_MOUNTS+=(-v "$d:$d:ro")
done

if [[ ${MG_DOCKER_NO_BUILD:-0} != 1 ]]; then
    phase "rootfs image (mmdebstrap)"
    if podman image exists "$ROOTFS_TAG"; then
        echo "cached: $ROOTFS_TAG"
    else
        # Only the machine's Debian mirror (from its apt sources), not third-party repos.
        MIRRORS=()
        for f in "${APT_SOURCES[@]}"; do MIRRORS+=("$f"); done
        ((${#MIRRORS[@]})) || MIRRORS=(http://deb.debian.org/debian)
        rm -f "$WORK/rootfs.tar"
        mmdebstrap --quiet --variant=minbase --include="$ROOTFS_PACKAGES" \
            "$SUITE" "$WORK/rootfs.tar" "${MIRRORS[@]}"
        podman import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$ROOTFS_TAG" > /dev/null
        rm -f "$WORK/rootfs.tar"
        echo "built: $ROOTFS_TAG"
    fi

    phase "cpu base image (torch CPU)"
    if podman image exists "$BASE_TAG"; then
        echo "cached: $BASE_TAG"
    else
        [[ -e ${TORCH_WHEELS[0]} ]] || { echo "no torch 2.13.0 CPU wheel in /opt/wheels" >&2; exit 2; }
        ctx=$WORK/base-context
        rm -rf "$ctx" && mkdir -p "$ctx/ca"
        # The machine's extra CA certificates go into this LOCAL TEST BASE only.
        [[ -e ${CA_FILES[0]} ]] && cp "${CA_FILES[@]}" "$ctx/ca/"
        podman build --quiet --format docker --pull=never \
            --build-arg ROOTFS_IMAGE="$ROOTFS_TAG" "${BUILD_MOUNTS[@]}" \
            -f docker/cpu-base.Dockerfile -t "$BASE_TAG" "$ctx" > /dev/null
        rm -rf "$ctx"
        echo "built: $BASE_TAG"
    fi

    phase "image build (docker/Dockerfile)"
    build_rc=$WORK/build.rc
    { podman build --format docker --pull=never \
        --build-arg BASE_IMAGE="$BASE_TAG" --build-arg MG_INSTALL=cpu \
        "${BUILD_MOUNTS[@]}" -f docker/Dockerfile -t "$IMAGE" . 2>&1 \
        && echo 0 > "$build_rc" || echo $? > "$build_rc"; } \
        | grep --line-buffered -v -E '^ *(Requirement already satisfied|Using cached|Downloading|Collecting|Obtaining|Looking in)' \
        | grep --line-buffered -v -e 'is ignored: it is neither a file nor a directory' -e '━━━' -e '^sglang [^ ]* requires ' -e "^ERROR: pip's dependency resolver" || true
    [[ $(cat "$build_rc") == 0 ]] || { echo "image build failed (podman build rc=$(cat "$build_rc"))" >&2; exit 1; }
    echo "image size: $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1/1e9}')"
    # Earlier builds of the tag are left untagged (~3 GB each): drop them.
    if [[ ${MG_DOCKER_PRUNE:-1} == 1 ]]; then podman image prune -f > /dev/null; fi
fi

# ---------------------------------------------------------------- run
phase "container start -> /health"
# shellcheck disable=SC2086  # MG_SERVE_ARGS is a word list on purpose
# (podman without systemd cannot schedule the periodic HEALTHCHECK and says so; it is run by
# hand below.)
podman run -d --name "$CONTAINER" -p "127.0.0.1:${PORT}:30000" --shm-size=1g \
    "$IMAGE" ${MG_SERVE_ARGS:-} 2> >(grep -v 'unable to get systemd connection' >&2) > /dev/null
deadline=$(( $(date +%s) + HEALTH_TIMEOUT ))
until curl -fsS -m 5 "$BASE_URL/health" > /dev/null 2>&1; do
    state=$(podman inspect --format '{{.State.Status}}' "$CONTAINER" 2>/dev/null || echo gone)
    if [[ $state != running ]]; then
        echo "container stopped before /health answered (state: $state)" >&2
        exit 1
    fi
    if (( $(date +%s) > deadline )); then
        echo "no healthy /health within ${HEALTH_TIMEOUT}s" >&2
        exit 1
    fi
    sleep 2
done
ok "/health answered after $(awk -v a="$PHASE_START" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')s"

# ---------------------------------------------------------------- checks
phase "HTTP checks"
code=$(curl -sS -m 10 -o "$TMP/health" -w '%{http_code}' "$BASE_URL/health")
[[ $code == 200 ]] && ok "/health 200" || fail "/health returned $code"

MODEL=$(curl -fsS -m 10 "$BASE_URL/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])') \
    && ok "/v1/models lists '$MODEL'" || { fail "/v1/models"; MODEL=default; }

chat_body=$(python3 -c 'import json,sys; print(json.dumps({"model": sys.argv[1], "max_tokens": 32,
    "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}))' "$MODEL")
code=$(curl -sS -m 120 -D "$TMP/chat.h" -o "$TMP/chat.json" -w '%{http_code}' \
    -H 'Content-Type: application/json' -H 'X-Deterministic: 1' -d "$chat_body" "$BASE_URL/v1/chat/completions")
if [[ $code == 200 ]]; then
    answer=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["choices"][0]["message"]["content"])' "$TMP/chat.json")
    echo "  answer: ${answer//$'\n'/ }"
    grep -q -i 'paris' <<< "$answer" && ok "deterministic chat answer mentions Paris" || fail "answer lacks 'Paris'"
    echoed=$(tr -d '\r' < "$TMP/chat.h" | awk -F': *' 'tolower($1)=="x-deterministic"{print $2}')
    [[ $echoed == 1 || $echoed == true ]] && ok "response echoes X-Deterministic: $echoed" \
        || fail "X-Deterministic not echoed (got '${echoed}')"
else
    fail "chat completion returned $code: $(head -c 400 "$TMP/chat.json")"
fi

code=$(curl -sS -m 30 -o "$TMP/bad.json" -w '%{http_code}' -H 'Content-Type: application/json' \
    -H 'X-Deterministic: maybe' -d "$chat_body" "$BASE_URL/v1/chat/completions")
if [[ $code == 400 ]] && python3 -c 'import json,sys; json.load(open(sys.argv[1]))' "$TMP/bad.json" 2> /dev/null; then
    ok "X-Deterministic: maybe -> 400 with JSON body"
else
    fail "X-Deterministic: maybe returned $code: $(head -c 300 "$TMP/bad.json")"
fi

curl -fsS -m 10 "$BASE_URL/metrics" > "$TMP/metrics" || fail "/metrics"
grep -q '^mg_deterministic_steps_total' "$TMP/metrics" \
    && ok "/metrics has $(grep -m1 '^mg_deterministic_steps_total' "$TMP/metrics")" \
    || fail "/metrics lacks mg_deterministic_steps_total"

uid=$(podman exec "$CONTAINER" id -u)
[[ $uid != 0 ]] && ok "server runs as uid $uid (non-root)" || fail "server runs as root"
if podman healthcheck run "$CONTAINER" > /dev/null 2>&1; then
    ok "image HEALTHCHECK passes"
else
    fail "image HEALTHCHECK failed"
fi

phase "container stop + removal"
stop_t0=$(date +%s.%N)
podman stop -t 30 "$CONTAINER" 2> >(grep -v 'unable to get systemd connection' >&2) > /dev/null
stop_s=$(awk -v a="$stop_t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}')
if awk -v s="$stop_s" 'BEGIN{exit !(s < 20)}'; then
    ok "graceful stop on SIGTERM in ${stop_s}s"
else
    fail "stop took ${stop_s}s (SIGTERM not handled; killed)"
fi
podman rm -f -t 5 "$CONTAINER" 2> >(grep -v 'unable to get systemd connection' >&2) > /dev/null
podman container exists "$CONTAINER" && fail "container still exists" || ok "container removed"
