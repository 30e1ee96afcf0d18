"""Redis Sentinel for tests: one primary, one replica and three sentinels on loopback.

:class:`SentinelGroup` starts them (``redis-server --sentinel`` with a generated config file
per sentinel, on free ports, stopped by PID), optionally with a password on the data nodes
(``requirepass``/``masterauth``, ``sentinel auth-pass``) and another on the sentinels
(``requirepass``, ``sentinel sentinel-pass``). :meth:`SentinelGroup.failover` forces
``SENTINEL FAILOVER`` and returns once every sentinel reports the new primary, it accepts
writes, and the old primary replicates from it.

Run it from the repository root: ``python -m tests.support.sentinel`` starts a group, prints
its ``sentinel://`` URL and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from tests.support.servers import RedisServer

__all__ = ["DataNode", "SentinelServer", "SentinelGroup"]


class DataNode(RedisServer):
    """A primary or replica of the group; ``password`` is its ``requirepass``."""

    def __init__(self, password: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.password = password

    def _probe_client(self):
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
            password=self.password,
        )


class SentinelServer(RedisServer):
    """A sentinel (``redis-server <config> --sentinel``) monitoring ``master_name`` at
    ``primary_port``; ``quorum`` sentinels must agree that the primary is down."""

    def __init__(
        self,
        master_name: str,
        primary_port: int,
        quorum: int = 2,
        password: str | None = None,
        sentinel_password: str | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.master_name = master_name
        self.primary_port = primary_port
        self.quorum = quorum
        self.password = password
        self.sentinel_password = sentinel_password
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def __repr__(self) -> str:
        return f"<SentinelServer 127.0.0.1:{self.port} pid={self.pid}>"

    @property
    def config_file(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "sentinel.conf"

    def _leading_args(self) -> list[str]:
        # Sentinel rewrites its config file (the state it learns), so every start gets a
        # fresh one; the file must be the first argument.
        name = self.master_name
        lines = [
            f"sentinel monitor {name} 127.0.0.1 {self.primary_port} {self.quorum}",
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {name} 1",
            "sentinel announce-ip 127.0.0.1",
        ]
        if self.password:
            lines.append(f"sentinel auth-pass {name} {self.password}")
        if self.sentinel_password:
            lines += [
                f"requirepass {self.sentinel_password}",
                f"sentinel sentinel-pass {self.sentinel_password}",
            ]
        self.config_file.write_text("\n".join(lines) + "\n")
        return [str(self.config_file), "--sentinel"]

    def _probe_client(self):
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
            password=self.sentinel_password,
        )

    def client(self):
        """A plain client of this sentinel (text replies)."""
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_timeout=2.0,
            password=self.sentinel_password,
            decode_responses=True,
        )


class SentinelGroup:
    """One primary, one replica and ``sentinels`` sentinels monitoring them as
    ``master_name``. ``password`` protects the data nodes, ``sentinel_password`` the
    sentinels. Use as a context manager or call :meth:`start`/:meth:`stop`."""

    def __init__(
        self,
        master_name: str = "steplock-primary",
        sentinels: int = 3,
        password: str | None = None,
        sentinel_password: str | None = None,
        workdir: str | Path | None = None,
    ):
        self.master_name = master_name
        self.password = password
        self.sentinel_password = sentinel_password
        self._workdir_arg = workdir
        self.workdir: Path | None = Path(workdir) if workdir else None
        self.count = sentinels
        self.nodes: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []

    def __repr__(self) -> str:
        return f"<SentinelGroup {self.url}>"

    # -- addresses ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """kombu's form: ``sentinel://[:password@]host:port;sentinel://...`` (no database:
        db 0), the password being the data nodes'."""
        auth = f":{self.password}@" if self.password else ""
        return ";".join(f"sentinel://{auth}127.0.0.1:{s.port}" for s in self.sentinels)

    @property
    def transport_options(self) -> dict:
        options = {"master_name": self.master_name}
        if self.sentinel_password:
            options["sentinel_kwargs"] = {"password": self.sentinel_password}
        return options

    def node_client(self, port: int):
        import redis

        return redis.Redis(
            host="127.0.0.1",
            port=port,
            socket_timeout=2.0,
            password=self.password,
            decode_responses=True,
        )

    def primary_port(self) -> int:
        """The port every sentinel reports as the primary's (raises when they disagree)."""
        ports = {self._reported(s) for s in self.sentinels}
        if len(ports) != 1 or None in ports:
            raise RuntimeError(f"sentinels disagree on the primary: {ports}")
        return ports.pop()

    def node(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _reported(self, sentinel: SentinelServer) -> int | None:
        client = sentinel.client()
        try:
            addr = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.master_name)
        finally:
            client.close()
        return int(addr[1]) if addr else None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> SentinelGroup:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="steplock-sentinel-"))
        auth = (
            ["--requirepass", self.password, "--masterauth", self.password]
            if self.password
            else []
        )
        try:
            primary = DataNode(self.password, workdir=self.workdir / "node-0", args=auth).start()
            self.nodes.append(primary)
            replica = DataNode(
                self.password,
                workdir=self.workdir / "node-1",
                args=[*auth, "--replicaof", "127.0.0.1", str(primary.port)],
            ).start()
            self.nodes.append(replica)
            self._wait_replicated(primary.port, replica.port, timeout)
            for i in range(self.count):
                self.sentinels.append(
                    SentinelServer(
                        self.master_name,
                        primary.port,
                        quorum=min(2, self.count),
                        password=self.password,
                        sentinel_password=self.sentinel_password,
                        workdir=self.workdir / f"sentinel-{i}",
                    ).start()
                )
            self._wait_discovered(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_replicated(self, primary: int, replica: int, timeout: float) -> None:
        client = self.node_client(replica)
        try:
            _wait(
                lambda: client.info("replication").get("master_link_status") == "up",
                timeout,
                f"replica :{replica} to sync from :{primary}",
            )
        finally:
            client.close()

    def _wait_discovered(self, timeout: float) -> None:
        """Until every sentinel knows the replica and the other sentinels (hello messages
        every 2 s): before that SENTINEL FAILOVER answers NOGOODSLAVE."""

        def ready() -> bool:
            for sentinel in self.sentinels:
                client = sentinel.client()
                try:
                    info = client.execute_command("SENTINEL", "MASTER", self.master_name)
                finally:
                    client.close()
                fields = dict(zip(info[::2], info[1::2])) if isinstance(info, list) else info
                if (
                    int(fields.get("num-slaves", 0)) < 1
                    or int(fields.get("num-other-sentinels", 0)) < self.count - 1
                ):
                    return False
            return True

        _wait(ready, timeout, "sentinels to discover the replica and each other")

    def failover(self, timeout: float = 30.0) -> tuple[int, int]:
        """Force a failover; returns ``(old_primary_port, new_primary_port)`` once every
        sentinel reports the new primary, it accepts a write and the old primary is its
        replica with the link up."""
        old = self.primary_port()
        deadline = time.monotonic() + timeout
        self.request_failover(timeout)

        def switched() -> bool:
            ports = {self._reported(s) for s in self.sentinels}
            return len(ports) == 1 and ports != {old}

        t0 = time.monotonic()
        _wait(
            switched,
            max(deadline - time.monotonic(), 1.0),
            "every sentinel to report the new primary",
        )
        self.timings = {"switched": time.monotonic() - t0}
        new = self.primary_port()
        primary = self.node_client(new)
        try:
            _wait(
                lambda: primary.info("replication").get("role") == "master",
                timeout,
                f"the new primary :{new} to be promoted",
            )
            primary.set("steplock-test:failover-probe", str(time.time()))
        finally:
            primary.close()
        self.timings["promoted"] = time.monotonic() - t0
        self._wait_replicated(new, old, timeout)
        self.timings["demoted"] = time.monotonic() - t0
        return old, new

    def request_failover(self, timeout: float = 30.0) -> None:
        """Send ``SENTINEL FAILOVER`` to the first sentinel, again every 0.2 s while it is
        refused (NOGOODSLAVE until the replica looks healthy, INPROG); RuntimeError after
        ``timeout`` seconds. Returns at once: :meth:`failover` also waits for the outcome,
        :meth:`converged` says when the group is at rest again."""
        client = self.sentinels[0].client()
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.execute_command("SENTINEL", "FAILOVER", self.master_name)
                    return
                except Exception as exc:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"SENTINEL FAILOVER kept failing: {exc}") from exc
                    time.sleep(0.2)
        finally:
            client.close()

    def roles(self) -> dict[int, tuple[str, int | None]]:
        """port -> (role, the port it replicates from or None) of every data node, as each
        answers ``INFO replication`` now (``("down", None)`` for one that does not answer)."""
        roles: dict[int, tuple[str, int | None]] = {}
        for node in self.nodes:
            client = self.node_client(node.port)
            try:
                info = client.info("replication")
                upstream = info.get("master_port") if info.get("role") == "slave" else None
                up = info.get("role") == "master" or info.get("master_link_status") == "up"
                roles[node.port] = (info["role"] if up else "syncing", upstream)
            except Exception:  # noqa: BLE001 - a node restarting
                roles[node.port] = ("down", None)
            finally:
                client.close()
        return roles

    def converged(self) -> int | None:
        """The primary's port when the group is at rest (every sentinel reports it, it is the
        only node with role master, every other node replicates from it with the link up),
        else None."""
        try:
            primary = self.primary_port()
        except Exception:  # noqa: BLE001 - they disagree, or one does not answer
            return None
        roles = self.roles()
        if roles.get(primary) != ("master", None):
            return None
        others = [r for port, r in roles.items() if port != primary]
        return primary if all(r == ("slave", primary) for r in others) else None

    def stop(self) -> None:
        for server in [*self.sentinels, *self.nodes]:
            server.stop()
        self.sentinels.clear()
        self.nodes.clear()
        if self._workdir_arg is None and self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _wait(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:  # a node restarting or reconfiguring
            last = exc
        time.sleep(interval)
    raise RuntimeError(
        f"timed out after {timeout:g}s waiting for {what}"
        + (f" (last error: {last})" if last else "")
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--password")
    parser.add_argument("--sentinel-password")
    args = parser.parse_args(argv)
    with SentinelGroup(password=args.password, sentinel_password=args.sentinel_password) as group:
        print(group.url, group.transport_options, flush=True)
        try:
            while all(s.alive() for s in group.sentinels):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
