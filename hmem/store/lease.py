"""The writer's lease of a store on object storage (docs/format.md, "The
writer's lease"): taken with a create-only write, or over an expired one
with a write conditional on its ETag; renewed in the background; given
back at close."""

from __future__ import annotations

import getpass
import os
import socket
import threading
import time
import uuid
from typing import Any

from hmem.errors import Hint, StoreLockedError
from hmem.formats import objects as fmt
from hmem.object_store import ConditionFailed, ObjectClient, ObjectMissing


def _owner() -> dict[str, Any]:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return {"host": socket.gethostname(), "pid": os.getpid(), "user": user}


class LeaseHolder:
    """The lease of a store's single writer, held and renewed in the
    background until ``release`` (docs/format.md, "The writer's lease")."""

    def __init__(self, client: ObjectClient, seconds: float, wait_seconds: float = 0.0) -> None:
        self.client = client
        self.seconds = seconds
        self.token = uuid.uuid4().hex
        self.owner = _owner()
        self.lost = False
        self._stop = threading.Event()
        self._etag = self._acquire(wait_seconds)
        self._thread = threading.Thread(target=self._renew_loop, name="hmem-lease", daemon=True)
        self._thread.start()

    def _document(self) -> bytes:
        self.expires = time.time() + self.seconds
        return fmt.Lease(self.token, self.owner, self.expires).to_bytes()

    def _acquire(self, wait_seconds: float) -> str:
        deadline = time.monotonic() + max(0.0, wait_seconds)
        while True:
            try:
                return self.client.put(fmt.LEASE_KEY, self._document(), create_only=True)
            except ConditionFailed:
                pass
            try:
                data, etag = self.client.get(fmt.LEASE_KEY)
            except ObjectMissing:
                continue  # released meanwhile
            held = fmt.Lease.parse(data)
            if held is None or held.expires < time.time():
                try:  # expired: take it over, unless someone else just did
                    return self.client.put(fmt.LEASE_KEY, self._document(), if_match=etag)
                except ConditionFailed:
                    continue
            if time.monotonic() >= deadline:
                owner = held.owner
                left = max(0.0, held.expires - time.time())
                raise StoreLockedError(
                    f"{self.client.url} is locked for writing by pid {owner.get('pid')} on {owner.get('host')} "
                    f"(user {owner.get('user')}); its lease runs {left:.0f} s more unless renewed",
                    hint=Hint.LOCK_WAIT,
                )
            time.sleep(min(0.25, max(0.01, deadline - time.monotonic())))

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3):
            try:
                self._etag = self.client.put(fmt.LEASE_KEY, self._document(), if_match=self._etag)
            except ConditionFailed:
                self.lost = True  # taken over: this writer may not commit again
                return
            except Exception:  # the server is unreachable: try again while the lease lasts
                if time.time() >= self.expires:
                    self.lost = True
                    return

    def check(self) -> None:
        """Raise unless the lease is held with time to spare for a commit."""
        if self.lost or time.time() > self.expires - min(5.0, self.seconds / 4):
            self.lost = True
            raise StoreLockedError(
                f"this writer lost its lease on {self.client.url} (another writer may hold it "
                "now): nothing more is committed",
                hint=Hint.OPEN_AGAIN,
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=min(self.seconds, 5.0))
        if self.lost:
            return
        self.lost = True
        try:  # give it back at once rather than let it expire
            self.client.put(fmt.LEASE_KEY, fmt.Lease(self.token, self.owner, 0.0).to_bytes(), if_match=self._etag)
        except Exception:
            pass  # it expires by itself
