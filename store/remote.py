"""A shared snapshot store on any S3-compatible object store: immutable blobs and one ref per corpus.

Layout under `s3://bucket/prefix`:
  snapshots/<digest>.safetensors   a snapshot file as written locally; named by its key digest, so
                                   its content never changes and a reader can verify it (checksum)
  refs/<corpus>.json               {"corpus", "source", "model", "shards": [digest...], "documents",
                                   "created", "generation", ...}: which snapshots are current

Order of writes: every blob a ref names is uploaded completely before the ref is written. An S3
PUT is atomic (an interrupted upload leaves no object), and a blob is uploaded under its final
name, never renamed (S3 has no atomic rename): a blob without a ref is harmless, a ref never names
a partial blob. Refs are written with conditional PUTs (`If-None-Match: *` for a new corpus,
`If-Match: <etag read>` for an update), so of two machines racing on one corpus the second is
refused (StoreConflict) instead of silently overwriting; a store that ignores those headers is
caught by reading the ref back after the write.

Healing: a blob carries the blake3 of its bytes as object metadata (`x-amz-meta-blake3`), and an upload is skipped only
when the stored object has that size and that digest, so a blob damaged or replaced in the store (which drops or
contradicts the digest) is sent again by the next ingest (a blob stored before the digest existed is sent once more).
The digest is only a claim (an overwrite can copy it, bit rot keeps it): a machine whose fetch fails verification leaves
a note (`snapshots/<digest>.safetensors.failed`), and the next put of that blob uploads it whatever it claims. A blob a
ref names that is missing, or a ref that is not a ref, is StoreCorrupt (exit 1, 503), never StoreUnreachable: an ingest
does not adopt such a ref, rebuilds, and overwrites it (its conditional write expects the bad ref's ETag).

Why s3fs: it is the S3 filesystem of fsspec (kept by the Dask/fsspec maintainers), reads the usual
AWS settings (AWS_ENDPOINT_URL, keys, region, profiles), and passes PutObject's IfMatch /
IfNoneMatch through to botocore; obstore (Rust) is faster per request but adds a compiled
dependency, and a snapshot fetch is one large sequential download either way.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import blake3

from cag.errors import BadSettings, StoreConflict, StoreCorrupt, StoreUnreachable

from .snapshot_header import SnapshotError, decode_header

# A single PUT carries up to 5 GiB; larger blobs go as a multipart upload (also atomic: the object
# appears only when the upload completes).
SINGLE_PUT_MAX = 4 * 1024**3


def parse_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at either end)."""
    u = urlparse(url)
    if u.scheme != "s3" or not u.netloc:
        raise BadSettings(f"bad setting CAG_STORE={url!r}: use s3://bucket or s3://bucket/prefix")
    return u.netloc, u.path.strip("/")


@dataclass
class Ref:
    """A corpus's ref as read from the store, with the ETag a conditional update must match."""

    body: dict
    etag: str
    broken: str = ""  # why the stored object is not a usable ref (read with broken_ok): an ingest overwrites it

    @property
    def generation(self) -> int:
        return int(self.body.get("generation", 0))

    @property
    def shards(self) -> list[str]:
        return list(self.body.get("shards", []))


class RemoteStore:
    """Blobs and refs under one bucket prefix. Every network failure is a one-line StoreUnreachable."""

    def __init__(self, url: str, connect_timeout: float = 5.0):
        import s3fs  # imported where used: only configurations with CAG_STORE pay for it

        self.url = url
        self.bucket, self.prefix = parse_url(url)
        # few retries and a short connect timeout: an unreachable store is reported in seconds, not
        # minutes; AWS_ENDPOINT_URL, keys and region come from the environment as botocore reads them
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        self.fs = s3fs.S3FileSystem(
            endpoint_url=endpoint, skip_instance_cache=True,
            config_kwargs={"connect_timeout": connect_timeout, "read_timeout": 60, "retries": {"max_attempts": 2}},
        )
        self.fs.retries = 2  # s3fs's own retry loop around botocore's (default 5, with back-off)

    # -- names -----------------------------------------------------------------------------------
    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def blob_key(self, digest: str) -> str:
        return self._key("snapshots", f"{digest}.safetensors")

    def ref_key(self, corpus: str) -> str:
        return self._key("refs", f"{corpus}.json")

    # -- calls -----------------------------------------------------------------------------------
    def _call(self, method: str, **kwargs):
        """One S3 call; a missing object is FileNotFoundError, a network failure StoreUnreachable."""
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, **kwargs)
        except (FileNotFoundError, FileExistsError, StoreConflict):
            raise
        except OSError as e:
            if "pre-condition" in str(e).lower() or "precondition" in str(e).lower():
                raise FileExistsError(str(e)) from None  # 412: a conditional write lost
            raise self._unreachable(e) from None
        except Exception as e:  # botocore EndpointConnectionError, aiohttp errors, timeouts
            raise self._unreachable(e) from None

    def _unreachable(self, e: Exception) -> StoreUnreachable:
        detail = " ".join(str(e).split())[:200] or type(e).__name__
        return StoreUnreachable(f"snapshot store {self.url} unreachable: {detail}")

    def _get(self, key: str) -> tuple[bytes, str]:
        from fsspec.asyn import sync

        async def get():
            r = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=key)
            async with r["Body"] as body:
                return await body.read(), r["ETag"]

        try:
            return sync(self.fs.loop, get)
        except FileNotFoundError:
            raise
        except Exception as e:  # botocore, aiohttp and OSError alike: the store did not answer
            raise self._unreachable(e) from None

    def ensure_bucket(self) -> None:
        """Create the bucket when missing (a walk-through on a fresh local server needs it)."""
        try:
            self._call("head_bucket")
        except FileNotFoundError:
            self._call("create_bucket")

    # -- blobs -----------------------------------------------------------------------------------
    def blob_head(self, digest: str) -> tuple[int, str | None] | None:
        """(size, blake3 of its bytes as recorded at upload, None when not recorded), or None: no such blob."""
        try:
            r = self._call("head_object", Key=self.blob_key(digest))
        except FileNotFoundError:
            return None
        return int(r["ContentLength"]), (r.get("Metadata") or {}).get("blake3")

    def failed_key(self, digest: str) -> str:
        return self._key("snapshots", f"{digest}.safetensors.failed")  # not a blob: blobs() lists *.safetensors

    def report_failed(self, digest: str, why: str) -> bool:
        """Note in the store that a fetched copy of this blob failed verification, so that the next
        put_blob of it uploads instead of trusting the blob's blake3 claim (metadata that an
        overwrite can copy and bit rot keeps). False when the note could not be written (read-only
        credentials, the store gone meanwhile)."""
        try:
            self._call("put_object", Key=self.failed_key(digest), Body=why.encode()[:2000])
        except (StoreUnreachable, FileNotFoundError, FileExistsError):
            return False
        return True

    def put_blob(self, path: Path, digest: str) -> None:
        """Upload a finished snapshot file under its final name, with the blake3 of its bytes. A blob
        already there with the same size and digest (the same content) is not sent again, unless a
        machine reported its bytes failing verification (report_failed); it is copied onto itself so
        that its LastModified is now, which keeps `gc` (grace period) from deleting it before the
        ref that names it again is written. Any other blob under that name (damaged, replaced, or
        stored without a digest) is overwritten: the verified local file is what the ref will name."""
        size, content = path.stat().st_size, file_digest(path)
        key, meta = self.blob_key(digest), {"blake3": content}
        reported = self._exists(self.failed_key(digest))
        if not reported and self.blob_head(digest) == (size, content):
            self._call(
                "copy_object",
                Key=key,
                CopySource={"Bucket": self.bucket, "Key": key},
                MetadataDirective="REPLACE",
                Metadata=meta,
            )
            return
        self._upload(path, key, size, meta)
        if reported:  # the report is answered: the stored bytes are the verified local file's now
            self._call("delete_object", Key=self.failed_key(digest))

    def _exists(self, key: str) -> bool:
        try:
            self._call("head_object", Key=key)
        except FileNotFoundError:
            return False
        return True

    def _upload(self, path: Path, key: str, size: int, meta: dict) -> None:
        if size > SINGLE_PUT_MAX:
            try:
                self.fs.put_file(str(path), f"{self.bucket}/{key}", Metadata=meta)
            except OSError as e:
                raise self._unreachable(e) from None
            return
        with open(path, "rb") as f:
            self._call("put_object", Key=key, Body=f, ContentLength=size, Metadata=meta)

    def _missing(self, digest: str) -> SnapshotError:
        return SnapshotError(f"snapshot {digest[:12]} is missing from the store {self.url}")

    def get_blob(self, digest: str, dest: Path) -> None:
        """Download a blob to `dest` (a temp name; the cache verifies it and renames it). A blob
        missing from a store that answers is a SnapshotError (a ref names it: the store is damaged)."""
        try:
            self.fs.get_file(f"{self.bucket}/{self.blob_key(digest)}", str(dest))
        except FileNotFoundError:
            raise self._missing(digest) from None
        except Exception as e:  # botocore, aiohttp and OSError alike: the store did not answer
            raise self._unreachable(e) from None

    def read_header(self, digest: str) -> tuple[dict, int]:
        """A blob's safetensors metadata (JSON values decoded, its header checksum checked) from two
        ranged reads, and its size. SnapshotError when the blob is missing or its header unreadable."""
        key = self.blob_key(digest)
        try:
            head = self._call("get_object", Key=key, Range="bytes=0-7")
            size = int(head["ContentRange"].rsplit("/", 1)[1])
            n = int.from_bytes(self._read_body(head), "little")
            if not 0 < n <= min(size - 8, 100 * 1024**2):
                raise ValueError(f"header length {n} in a blob of {size} bytes")
            raw = json.loads(self._read_body(self._call("get_object", Key=key, Range=f"bytes=8-{8 + n - 1}")))
            meta = raw.get("__metadata__") or {}
            if not isinstance(meta, dict):
                raise ValueError("__metadata__ is not an object")
        except FileNotFoundError:
            raise self._missing(digest) from None
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise SnapshotError(f"snapshot {digest[:12]} in the store: header unreadable ({e})") from None
        return decode_header(meta, f"snapshot {digest[:12]} in the store"), size

    def _read_body(self, response) -> bytes:
        from fsspec.asyn import sync

        async def read():
            async with response["Body"] as body:
                return await body.read()

        return sync(self.fs.loop, read)

    def blobs(self) -> list[dict]:
        """Every blob: {digest, bytes, modified (epoch s)}."""
        out = []
        for obj in self._list(self._key("snapshots") + "/"):
            name = obj["Key"].rsplit("/", 1)[1]
            if name.endswith(".safetensors"):
                out.append({"digest": name.removesuffix(".safetensors"), "bytes": int(obj["Size"]),
                            "modified": obj["LastModified"].timestamp()})
        return out

    def delete_blob(self, digest: str) -> None:
        self._call("delete_object", Key=self.blob_key(digest))
        self._call("delete_object", Key=self.failed_key(digest))  # its failure report, if any (a no-op when none)

    def _list(self, prefix: str) -> list[dict]:
        out, token = [], None
        while True:
            kw = {"Prefix": prefix, **({"ContinuationToken": token} if token else {})}
            r = self._call("list_objects_v2", **kw)
            out += r.get("Contents", [])
            if not r.get("IsTruncated"):
                return out
            token = r["NextContinuationToken"]

    # -- refs ------------------------------------------------------------------------------------
    def get_ref(self, corpus: str, broken_ok: bool = False) -> Ref | None:
        """The corpus's ref, None when it has none. A stored object that is not a ref (not JSON, or
        not the fields a ref needs) is StoreCorrupt, or with `broken_ok` (an ingest about to write it
        again) a Ref with an empty body and `broken` saying why, whose ETag the overwrite expects."""
        try:
            data, etag = self._get(self.ref_key(corpus))
        except FileNotFoundError:
            return None
        why = ref_problem(data, corpus)
        if why and not broken_ok:
            raise StoreCorrupt(f"ref of {corpus!r} in {self.url} is corrupt ({why}); run `cag ingest {corpus}` "
                               f"to write it again (`cag ingest PATH --name {corpus}` where {corpus!r} is unknown)")
        return Ref({}, etag, why) if why else Ref(json.loads(data), etag)

    def ref_names(self) -> list[str]:
        """The corpus names the store holds a ref object for (each may still be corrupt)."""
        names = (obj["Key"].rsplit("/", 1)[1] for obj in self._list(self._key("refs") + "/"))
        return [n.removesuffix(".json") for n in names if n.endswith(".json")]

    def refs(self) -> list[Ref]:
        """Every ref; StoreCorrupt when any is corrupt (what `gc` needs: it cannot tell what that one names)."""
        return [ref for name in self.ref_names() if (ref := self.get_ref(name)) is not None]

    def put_ref(self, body: dict, expect: Ref | None) -> Ref:
        """Write a corpus's ref if it is still the one read as `expect` (None: there was none).
        Raises StoreConflict when another machine moved it meanwhile."""
        corpus = body["corpus"]
        cond = {"IfMatch": expect.etag} if expect else {"IfNoneMatch": "*"}
        data = json.dumps(body, ensure_ascii=False, sort_keys=True).encode()
        try:
            r = self._call("put_object", Key=self.ref_key(corpus), Body=data, ContentType="application/json", **cond)
        except (FileExistsError, FileNotFoundError):  # 412, or the ref we expected was deleted
            raise self._conflict(corpus) from None
        mine = Ref(body, r["ETag"])
        back = self.get_ref(corpus)  # a store that ignores conditional headers: last writer wins, and we say so
        if back is None or back.body != json.loads(data):
            raise self._conflict(corpus, back)
        return mine

    def _conflict(self, corpus: str, now: Ref | None = None) -> StoreConflict:
        now = now or self.get_ref(corpus)
        gen = f" (now generation {now.generation}, from {now.body.get('host', '?')})" if now else ""
        return StoreConflict(f"corpus {corpus!r} was published by another ingest meanwhile{gen}; your snapshot "
                             f"is uploaded but not current: run `cag ingest {corpus}` again")


def file_digest(path: Path) -> str:
    """blake3 of a file's bytes (what a stored blob's `blake3` metadata says it holds)."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    h.update_mmap(str(path))
    return h.hexdigest()


def ref_problem(data: bytes, corpus: str) -> str:
    """Why a stored ref cannot be used ("" when it can): what adopt and gc read must be there."""
    try:
        body = json.loads(data)
    except ValueError:
        return "not JSON"
    if not isinstance(body, dict):
        return "not a JSON object"
    if body.get("corpus") != corpus:
        return f"it names corpus {str(body.get('corpus'))[:40]!r}"
    shards = body.get("shards")
    if not isinstance(shards, list) or not shards or not all(isinstance(d, str) and d.isalnum() for d in shards):
        return "its shards are not a list of snapshot digests"
    docs = body.get("documents", [])
    if not isinstance(docs, list) or not all(isinstance(d, dict) and isinstance(d.get("path"), str)
                                              and isinstance(d.get("content_hash"), str) for d in docs):
        return "its documents are not a list of {path, content_hash}"
    try:
        int(body.get("generation", 0))
    except (TypeError, ValueError):
        return "its generation is not a number"
    return ""
