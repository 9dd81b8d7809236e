"""The one module that talks to object storage (S3 and S3-compatible
servers: MinIO, R2, GCS's S3 API), as hmem/_io.py is the one that writes
local files.

A store on object storage is named by a URL, ``s3://bucket/prefix``
(docs/format.md, "Stores on object storage").  Endpoint and credentials
come from the standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_SESSION_TOKEN); `storage_options`
override them.  Requests go through obstore (a maintained client whose
conditional writes map to If-None-Match and If-Match; docs/benchmarks.md,
"Object storage", says why it was chosen), with a bounded timeout and few
retries so that a server that stops answering gives a clean error rather
than a hang: `timeout` (30 s by default) bounds one request, and retries
are made only within that same time from the first attempt, so a server
that does not answer fails a call after one timeout, not after one per
retry (docs/cli.md, "Failures").  Every request is counted (`ObjectStats`):
``hmem stats`` shows them.
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hmem import validation
from hmem.errors import (
    CorruptStoreError,
    Hint,
    InvalidArgumentError,
    ObjectStoreError,
    PathError,
    PermissionDeniedError,
)

# s3:// is S3 or an S3-compatible server; memory:// holds the objects in this
# process's memory, one namespace per bucket name, gone when the process ends:
# the same client and conditional writes (obstore's MemoryStore), for tests
# and trials that need no server
SCHEMES = ("s3://", "memory://")
# storage_options hmem understands; anything else is refused by name
OPTION_NAMES = (
    "endpoint",
    "access_key_id",
    "secret_access_key",
    "session_token",
    "region",
    "allow_http",
    "timeout",
    "connect_timeout",
    "max_retries",
)
_DEFAULT_TIMEOUT = 30.0  # seconds per request
_DEFAULT_CONNECT_TIMEOUT = 5.0
_DEFAULT_RETRIES = 3
PART_BYTES = 8 << 20  # objects larger than this are uploaded in parts of this size
_NO_SUCH_BUCKET = "<Code>NoSuchBucket</Code>"  # in the body of S3's 404 for a bucket that does not exist
# a range starting at or past an object's end: S3's 416, and memory://'s error
_INVALID_RANGES = ("<Code>InvalidRange</Code>", "Invalid range: Wanted range starting at")


def is_url(location: object) -> bool:
    """Whether `location` names a store on object storage rather than a directory."""
    return isinstance(location, str) and location.startswith(SCHEMES)


def _invalid_range(exc: Exception) -> bool:
    return any(text in str(exc) for text in _INVALID_RANGES)


class ConditionFailed(Exception):
    """A conditional write lost: the object exists (create) or changed (update)."""


class ObjectMissing(Exception):
    """The object does not exist."""


@dataclasses.dataclass
class ObjectStats:
    """Requests made and bytes moved by one client, by kind."""

    gets: int = 0
    puts: int = 0
    deletes: int = 0
    lists: int = 0
    bytes_fetched: int = 0
    bytes_sent: int = 0

    @property
    def requests(self) -> int:
        return self.gets + self.puts + self.deletes + self.lists


@dataclasses.dataclass(frozen=True)
class Location:
    """A parsed store URL."""

    url: str
    bucket: str
    prefix: str  # without leading or trailing "/"; "" for the bucket's root
    scheme: str = "s3"  # "s3" or "memory"

    def at(self, prefix: str) -> str:
        """The URL of `prefix` in the same bucket."""
        return f"{self.scheme}://{self.bucket}/{prefix}".rstrip("/")


def parse_url(url: str) -> Location:
    if not is_url(url):
        raise InvalidArgumentError(f"{url!r} is not an object-store URL", hint="give s3://bucket/prefix")
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or "//" in prefix or any(part in (".", "..") for part in prefix.split("/") if prefix):
        raise InvalidArgumentError(f"{url!r} is not a valid store URL", hint=f"give {scheme}://bucket/prefix")
    return Location(f"{scheme}://{bucket}/{prefix}".rstrip("/"), bucket, prefix, scheme)


# memory:// buckets: one object namespace per name, for the life of the process
_MEMORY_BUCKETS: dict[str, Any] = {}
_MEMORY_LOCK = threading.Lock()


def _memory_bucket(name: str) -> Any:
    from obstore.store import MemoryStore

    with _MEMORY_LOCK:
        store = _MEMORY_BUCKETS.get(name)
        if store is None:
            store = _MEMORY_BUCKETS[name] = MemoryStore()
        return store


def _seconds(value: Any, name: str) -> float:
    return validation.positive(value, f"storage option {name}", high=86400)  # a day at most


class ObjectClient:
    """The objects under one store URL: whole and ranged reads, plain and
    conditional writes, deletes and listings, each counted."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.location = parse_url(url)
        options = dict(storage_options or {})
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise InvalidArgumentError(
                f"unknown storage option(s): {', '.join(unknown)}",
                hint="storage options are " + ", ".join(OPTION_NAMES),
            )
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError:
            raise InvalidArgumentError(
                "stores on object storage need the obstore package", hint="install it with pip install 'hmem[s3]'"
            ) from None
        self._obstore = obstore
        self.stats = ObjectStats()
        self._stats_lock = threading.Lock()
        self._options = options  # as given: a client for another prefix of the bucket is made with them
        if self.location.scheme == "memory":
            if options:
                raise InvalidArgumentError(
                    f"storage options do not apply to {self.location.url} (objects in this process's memory)"
                )
            self.endpoint, self.timeout = "memory", 0.0
            self._store = _memory_bucket(self.location.bucket)
            # one namespace per bucket: the prefix is put in front of every key here
            self._key_prefix = f"{self.location.prefix}/" if self.location.prefix else ""
            return
        self._key_prefix = ""  # S3Store adds the prefix itself
        env = os.environ
        endpoint = options.get("endpoint", env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
        config: dict[str, Any] = {}
        for name, variable in (
            ("access_key_id", "AWS_ACCESS_KEY_ID"),
            ("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
            ("session_token", "AWS_SESSION_TOKEN"),
        ):
            value = options.get(name, env.get(variable))
            if value:
                config[name] = str(value)
        config["region"] = str(
            options.get("region", env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1")
        )
        if endpoint:
            config["endpoint"] = str(endpoint)
        allow_http = options.get("allow_http", bool(endpoint) and str(endpoint).startswith("http://"))
        timeout = _seconds(options.get("timeout", _DEFAULT_TIMEOUT), "timeout")
        connect = _seconds(options.get("connect_timeout", _DEFAULT_CONNECT_TIMEOUT), "connect_timeout")
        retries = validation.integer(
            options.get("max_retries", _DEFAULT_RETRIES), "storage option max_retries", low=0, high=20
        )
        self.endpoint = config.get("endpoint", "AWS")
        self.timeout = timeout
        try:
            self._store = S3Store(
                self.location.bucket,
                prefix=self.location.prefix or None,
                client_options={
                    "allow_http": bool(allow_http),
                    "timeout": datetime.timedelta(seconds=timeout),
                    "connect_timeout": datetime.timedelta(seconds=connect),
                },
                retry_config={
                    "max_retries": retries,
                    # Retries only within the timeout of the first attempt: a
                    # server that does not answer fails after one timeout (the
                    # documented 30 s), not after one per retry (4 x 30 s); one
                    # that answers with an error is retried within that time.
                    "retry_timeout": datetime.timedelta(seconds=timeout),
                    "backoff": {
                        "init_backoff": datetime.timedelta(milliseconds=100),
                        "max_backoff": datetime.timedelta(seconds=2),
                        "base": 2,
                    },
                },
                **config,
            )
        except Exception as exc:  # a malformed endpoint or option, from the client
            raise InvalidArgumentError(f"cannot use {url}: {exc}") from None

    @property
    def url(self) -> str:
        return self.location.url

    def at(self, prefix: str, *, shared_counts: bool = True) -> ObjectClient:
        """A client for a prefix of the same bucket, with the same options,
        counting its requests with this one's (`shared_counts`) or apart."""
        other = ObjectClient(self.location.at(prefix), self._options)
        if shared_counts:
            other.stats, other._stats_lock = self.stats, self._stats_lock
        return other

    def _count(self, kind: str, fetched: int = 0, sent: int = 0, requests: int = 1) -> None:
        with self._stats_lock:
            setattr(self.stats, kind, getattr(self.stats, kind) + requests)
            self.stats.bytes_fetched += fetched
            self.stats.bytes_sent += sent

    def _fail(self, exc: Exception, operation: str, key: str) -> Exception:
        """The hmem error for a failed request (the client's own errors
        carry the whole HTTP exchange; keep its first line)."""
        from obstore import exceptions as obx

        where = f"{self.url}/{key}"
        if _NO_SUCH_BUCKET in str(exc):
            # S3 answers 404 for a key of a bucket that does not exist too:
            # not an object missing (a store not yet made) but a wrong URL
            bucket = self.location.bucket
            return PathError(
                f"bucket {bucket!r} does not exist at {self.endpoint}",
                path=f"s3://{bucket}",
                errno=errno.ENOENT,
                strerror="no such bucket",
                hint="check the URL and AWS_ENDPOINT_URL, or create the bucket first",
            )
        if isinstance(exc, obx.NotFoundError) or isinstance(exc, FileNotFoundError):
            return ObjectMissing(key)
        if isinstance(exc, (obx.AlreadyExistsError, obx.PreconditionError)):
            return ConditionFailed(key)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if len(first) > 300:
            first = first[:300] + "..."
        if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
            return PermissionDeniedError(
                f"cannot {operation} {where}: {first}",
                path=where,
                hint="check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)",
            )
        return ObjectStoreError(
            f"cannot {operation} {where}: {first}",
            path=where,
            hint=f"check that {self.endpoint} is reachable (a request gives up after {self.timeout:g} s), "
            "then try again",
        )

    # ---- reads -----------------------------------------------------------------------

    def get(self, key: str, *, max_bytes: int | None = None) -> tuple[bytes, str]:
        """An object's bytes and its ETag.  `max_bytes`: an object larger
        than that is a damaged store (CorruptStoreError), refused from the
        size the answer announces, before its body is read."""
        try:
            result = self._obstore.get(self._store, self._key_prefix + key)
            size = int(result.meta["size"])
            if max_bytes is not None and size > max_bytes:
                self._count("gets")
                raise CorruptStoreError(
                    f"{self.url}/{key} is {size} bytes, more than the {max_bytes} the store says it holds",
                    hint=Hint.VERIFY,
                )
            data = bytes(result.bytes())
        except CorruptStoreError:
            raise
        except Exception as exc:
            self._count("gets")
            raise self._fail(exc, "read", key) from None
        self._count("gets", fetched=len(data))
        return data, str(result.meta["e_tag"])

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object.  An object shorter than that (a
        size a manifest claimed) is a damaged store, not a failed request:
        CorruptStoreError, as the same short local file is."""

        def short(got: int) -> CorruptStoreError:
            return CorruptStoreError(
                f"{self.url}/{key} is shorter than the store says: asked {end - start} bytes from {start}, got {got}",
                hint=Hint.VERIFY,
            )

        try:
            data = bytes(self._obstore.get_range(self._store, self._key_prefix + key, start=start, end=end))
        except Exception as exc:
            self._count("gets")
            if _invalid_range(exc):
                raise short(0) from None  # S3's 416: the range starts at or past the object's end
            raise self._fail(exc, "read", key) from None
        self._count("gets", fetched=len(data))
        if len(data) != end - start:
            raise short(len(data))
        return data

    def get_start(self, key: str, size: int) -> bytes | None:
        """At most the first `size` bytes of an object (all of a shorter
        one); None when it does not exist.  One request."""
        try:
            data = bytes(self._obstore.get_range(self._store, self._key_prefix + key, start=0, end=size))
        except Exception as exc:
            self._count("gets")
            if _invalid_range(exc):
                return b""  # S3 refuses any range of an empty object (416)
            failure = self._fail(exc, "read", key)
            if isinstance(failure, ObjectMissing):
                return None
            raise failure from None
        self._count("gets", fetched=len(data))
        return data

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """(key, size) of every object under `prefix`, keys relative to the store."""
        return list(self.iter_list(prefix))

    def iter_list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size) of the objects under `prefix`, a page of up to 1,000
        keys (one request) at a time: a caller that stops early makes no
        more requests."""
        pages = 0
        # batches of 1,000 keys, as S3 pages them: one batch, about one request
        listed = self._key_prefix + prefix
        batches = iter(self._obstore.list(self._store, prefix=listed or None, chunk_size=1000))
        strip = len(self._key_prefix)
        while True:
            try:
                batch = next(batches, None)
            except Exception as exc:
                self._count("lists")
                raise self._fail(exc, "list", prefix) from None
            if batch is None:
                if not pages:
                    self._count("lists")  # an empty listing is one request too
                return
            pages += 1
            self._count("lists")
            yield from ((str(meta["path"])[strip:], int(meta["size"])) for meta in batch)

    # ---- writes ----------------------------------------------------------------------

    def put(self, key: str, data: bytes | Path, *, create_only: bool = False, if_match: str | None = None) -> str:
        """Write an object whole; returns its new ETag.  `create_only`: only
        if no object has the key (If-None-Match: *); `if_match`: only if the
        object still has that ETag.  A lost condition raises ConditionFailed."""
        mode: Any = "overwrite"
        if create_only:
            mode = "create"
        elif if_match is not None:
            mode = {"e_tag": if_match}
        size = data.stat().st_size if isinstance(data, Path) else len(data)
        # past one part, an upload is multipart: a request to begin, one per
        # part, one to complete (a conditional write is always one request)
        multipart = mode == "overwrite" and size > PART_BYTES
        requests = -(-size // PART_BYTES) + 2 if multipart else 1
        try:
            result = self._obstore.put(
                self._store, self._key_prefix + key, data, mode=mode, use_multipart=multipart, chunk_size=PART_BYTES
            )
        except Exception as exc:
            self._count("puts")
            raise self._fail(exc, "write", key) from None
        self._count("puts", sent=size, requests=requests)
        return str(result["e_tag"])

    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects (a missing one is no error)."""
        for key in keys:
            try:
                self._obstore.delete(self._store, self._key_prefix + key)
            except Exception as exc:
                self._count("deletes")
                failure = self._fail(exc, "delete", key)
                if not isinstance(failure, ObjectMissing):
                    raise failure from None
                continue
            self._count("deletes")
