"""Checkpoints on S3: the commit protocol of ``atomic_dir`` for an object store.

Note [S3 checkpoint layout]
    S3 has no rename, so a checkpoint cannot be staged beside its name and renamed into
    place. What S3 does have is an atomic single-object PUT with read-after-write
    consistency, and that is the commit. A save of ``s3://bucket/run/step300``
      1. picks a fresh save id (the coordinator, as on a file system);
      2. has every rank write its DCP files under ``run/step300/<save id>/`` through
         ``s3torchconnector``'s DCP writer, checksumming each object as it streams out
         (Note [Checkpoint checksums]); DCP's coordinator writes ``.metadata`` last;
      3. has the coordinator PUT the completion marker ``run/step300/.sm_checkpoint_complete.json``
         (format, layout, size and CRC-32 of every object, and ``data``: the save id),
         the single write that makes the checkpoint visible;
      4. deletes the objects of every other save id under ``run/step300/`` (the replaced
         checkpoint, and what killed saves left).
    A save that fails or is killed before 3 leaves the previous marker, and the objects it
    names, untouched: the previous checkpoint of that name (or, with one name per step, the
    previous step's) stays loadable. ``load`` reads the marker, lists the objects under its
    save id and refuses missing objects or other sizes, re-checksums the objects (split
    among the loading ranks) and refuses one whose bytes changed, naming it, and only then
    lets DCP read. Step 4 deletes only names that are save ids (32 hex digits), never a
    checkpoint nested under another. Multipart uploads a killed rank left unfinished are
    invisible and hold no data anyone reads; a bucket lifecycle rule
    (``AbortIncompleteMultipartUpload``) reclaims their storage.
"""

from __future__ import annotations

import json
import re
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch_sagemaker.distributed.checkpoint import integrity
from torch_sagemaker.distributed.checkpoint.atomic_dir import CheckpointError, check_sizes
from torch_sagemaker.distributed.checkpoint.constants import COMPLETION_MARKER, FORMAT_VERSION
from torch_sagemaker.distributed.checkpoint.s3_filesystem import (
    format_s3_path,
    make_s3_client,
    parse_s3_uri,
    resolve_region,
    retry_with_jitter,
    s3_file_system_class,
)

#: Objects a rank checksums at once when verifying a load.
VERIFY_THREADS = 4
_SAVE_ID = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 8 << 20  # read size when checksumming an object
_METADATA = ".metadata"


class S3Checkpoint:
    """One checkpoint location ``s3://bucket/key`` (Note [S3 checkpoint layout]).

    Args:
        uri: The checkpoint's URI.
        s3_region: The bucket's region (default: the environment's, else the bucket's).
        s3client_config: An ``s3torchconnector.S3ClientConfig`` for every client made here.

    Raises:
        ValueError: If ``uri`` names a bucket but no key (a checkpoint needs a prefix).
    """

    def __init__(self, uri: str, s3_region: str | None = None, s3client_config: Any = None):
        self.uri = format_s3_path(uri)
        self.bucket, self.key = parse_s3_uri(self.uri)
        if not self.key:
            raise ValueError(
                f"checkpoint_id={uri!r} is a bucket; a checkpoint needs a key prefix, e.g. "
                f"s3://{self.bucket}/run/step100."
            )
        self.region = resolve_region(self.uri, s3_region)
        self.s3client_config = s3client_config
        self._client: Any = None

    def __str__(self) -> str:
        return self.uri

    # ----------------------------------------------------------------- objects
    @property
    def client(self) -> Any:
        """The ``s3torchconnector`` client (made on first use; it is safe across threads)."""
        if self._client is None:
            self._client = make_s3_client(self.region, self.s3client_config)
        return self._client

    @property
    def marker_key(self) -> str:
        """Key of the completion marker."""
        return f"{self.key}/{COMPLETION_MARKER}"

    def data_uri(self, save_id: str) -> str:
        """Where the files of save ``save_id`` go."""
        return f"{self.uri}/{save_id}"

    def _put(self, key: str, data: bytes) -> None:
        def put() -> None:
            with self.client.put_object(self.bucket, key) as stream:
                stream.write(data)

        retry_with_jitter(put)

    def _get(self, key: str) -> bytes:
        return retry_with_jitter(lambda: self.client.get_object(self.bucket, key).read())

    def _exists(self, key: str) -> bool:
        try:
            self.client.head_object(self.bucket, key)
        except Exception as e:  # noqa: BLE001 - S3Exception: not found, or no access
            if "NotFound" in str(e) or "NoSuchKey" in str(e) or "not found" in str(e).lower():
                return False
            raise
        return True

    def list_objects(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of every object under ``prefix``."""

        def listing() -> dict[str, int]:
            out = {}
            for page in self.client.list_objects(self.bucket, prefix):
                out.update({o.key: o.size for o in page.object_info})
            return out

        return retry_with_jitter(listing)

    def delete(self, keys: list[str]) -> None:
        """Deletes ``keys`` in order (each retried)."""

        def deleter(key: str) -> Callable[[], None]:
            return lambda: self.client.delete_object(self.bucket, key)

        for key in keys:
            retry_with_jitter(deleter(key))

    def checksum(self, key: str) -> str:
        """CRC-32 of an object, read once in chunks (``integrity.format_checksum``)."""

        def read() -> str:
            crc = 0
            reader = self.client.get_object(self.bucket, key)
            while chunk := reader.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
            return integrity.format_checksum(crc)

        return retry_with_jitter(read)

    # ------------------------------------------------------------ DCP storage
    def file_system(self, reader_constructor: Any = None) -> Any:
        """An ``S3FileSystem`` sharing this location's client."""
        return s3_file_system_class()(
            self.region, s3_client=self.client, reader_constructor=reader_constructor
        )

    def storage_writer(self, save_id: str, thread_count: int = 1) -> Any:
        """``s3torchconnector``'s DCP writer for save ``save_id``, on this location's client."""
        from s3torchconnector.dcp import S3StorageWriter

        writer = S3StorageWriter(
            self.region,
            self.data_uri(save_id),
            s3client_config=self.s3client_config,
            thread_count=thread_count,
        )
        writer.fs = self.file_system()  # its own client takes no endpoint (s3_filesystem)
        return writer

    def storage_reader(self, save_id: str) -> Any:
        """``s3torchconnector``'s DCP reader of save ``save_id`` (ranged, coalesced reads)."""
        from s3torchconnector import S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader

        # The reader sorts and coalesces each rank's byte ranges through its constructor,
        # so the file system must read through the very same constructor object.
        constructor = S3ReaderConstructor.dcp_optimized()
        reader = S3StorageReader(
            self.region,
            self.data_uri(save_id),
            s3client_config=self.s3client_config,
            reader_constructor=constructor,
        )
        reader.fs = self.file_system(reader_constructor=constructor)
        return reader

    # --------------------------------------------------------------- protocol
    def commit(self, save_id: str, info: dict[str, Any], recorded: dict[str, Any]) -> None:
        """Step 3: writes the marker over the objects of ``save_id`` (the coordinator)."""
        prefix = f"{self.key}/{save_id}/"
        sizes = {k[len(prefix) :]: s for k, s in sorted(self.list_objects(prefix).items())}
        if _METADATA not in sizes:
            raise CheckpointError(
                f"checkpoint {self.uri}: save {save_id} has no {_METADATA} object after DCP "
                "finished; not committing it."
            )
        checksums = {}
        for name, size in sizes.items():
            record = recorded.get(name)
            if record is not None and record[0] == size:  # all bytes seen while writing
                checksums[name] = record[1]
            else:
                checksums[name] = self.checksum(prefix + name)
        marker = {
            "format_version": FORMAT_VERSION,
            "time": time.time(),
            "files": sizes,
            "checksum_algorithm": integrity.ALGORITHM,
            "checksums": checksums,
            "data": save_id,
            **info,
        }
        self._put(self.marker_key, json.dumps(marker, indent=1, sort_keys=True).encode())

    def remove_replaced(self, save_id: str) -> list[str]:
        """Step 4: deletes the objects of every save id but ``save_id``; returns the ids."""
        stale: dict[str, list[str]] = {}
        for key in self.list_objects(f"{self.key}/"):
            first = key[len(self.key) + 1 :].split("/", 1)[0]
            if _SAVE_ID.match(first) and first != save_id:
                stale.setdefault(first, []).append(key)
        for keys in stale.values():
            self.delete(keys)
        return sorted(stale)

    def marker_save_id(self) -> str | None:
        """The save id the marker names, if there is a readable marker."""
        try:
            return json.loads(self._get(self.marker_key)).get("data")
        except Exception:  # noqa: BLE001 - no marker, or unreadable: no committed save
            return None

    def is_complete(self) -> bool:
        """Whether the location holds a committed checkpoint (it has a marker)."""
        return self._exists(self.marker_key)

    def where(self) -> str:
        """What the location holds now (for an outcome nobody could tell)."""
        if self.is_complete():
            return f"{self.uri} holds a complete checkpoint from an earlier save"
        return f"{self.uri} holds no complete checkpoint"

    def read_marker(self) -> dict[str, Any]:
        """The marker, after checking that every object it lists exists with its size.

        Raises:
            CheckpointError: If nothing is there, the save did not finish (no marker), the
                marker is unreadable, or an object is missing or has another size.
        """
        if not self._exists(self.marker_key):
            if self.list_objects(f"{self.key}/"):
                raise CheckpointError(
                    f"checkpoint {self.uri} is incomplete: it has no completion marker "
                    f"{COMPLETION_MARKER} (its save did not finish, or it was not written by "
                    "torch.sagemaker). Load an earlier checkpoint."
                )
            raise CheckpointError(f"checkpoint {self.uri} does not exist.")
        try:
            marker = json.loads(self._get(self.marker_key))
            files, checksums, save_id = marker["files"], marker["checksums"], marker["data"]
            if not isinstance(files, dict) or set(checksums) != set(files):
                raise ValueError("its file table is malformed")
            if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
                raise ValueError(f"its data id {save_id!r} is not a save id")
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {self.uri} is corrupt: its marker s3://{self.bucket}/"
                f"{self.marker_key} is unreadable ({type(e).__name__}: {e}). Load an earlier "
                "checkpoint."
            ) from e
        prefix = f"{self.key}/{save_id}/"
        actual = {k[len(prefix) :]: s for k, s in self.list_objects(prefix).items()}
        check_sizes(self.uri, files, actual, prefix=f"{save_id}/")
        return marker

    def verify(self, marker: dict[str, Any], names: list[str]) -> list[str]:
        """Problems found by re-checksumming ``names`` (``integrity.verify``), each named.

        The objects are read on up to ``VERIFY_THREADS`` threads: an object store answers
        concurrent GETs in parallel, and each read is mostly waiting (zlib releases the GIL).
        """
        prefix = f"{self.key}/{marker['data']}/"
        wanted = [n for n in names if n in marker["checksums"]]
        with ThreadPoolExecutor(max_workers=max(1, min(VERIFY_THREADS, len(wanted)))) as pool:
            futures = {n: pool.submit(self.checksum, prefix + n) for n in wanted}
            problems = integrity.verify_with(
                lambda name: futures[name].result(), names, marker["checksums"]
            )
        return [f"{marker['data']}/{p}" for p in problems]


def list_subdirs(uri: str, s3_region: str | None = None, s3client_config: Any = None) -> list[str]:
    """Names of the "directories" right under ``uri`` (the key prefixes ending in ``/``)."""
    uri = format_s3_path(uri)
    bucket, key = parse_s3_uri(uri)
    client = make_s3_client(resolve_region(uri, s3_region), s3client_config)
    prefix = f"{key}/" if key else ""

    def listing() -> list[str]:
        names = []
        for page in client.list_objects(bucket, prefix, "/"):
            names += [p[len(prefix) :].rstrip("/") for p in page.common_prefixes]
        return sorted(names)

    return retry_with_jitter(listing)


def delete_prefix(uri: str, s3_region: str | None = None, s3client_config: Any = None) -> int:
    """Deletes every object under the checkpoint ``uri``, completion markers first.

    Returns:
        The number of objects deleted.
    """
    location = S3Checkpoint(uri, s3_region, s3client_config)
    keys = sorted(location.list_objects(f"{location.key}/"))
    # Markers first: a deletion cut short must not leave a "complete" checkpoint behind.
    keys.sort(key=lambda k: not k.endswith(f"/{COMPLETION_MARKER}"))
    location.delete(keys)
    return len(keys)


__all__ = ["S3Checkpoint", "delete_prefix", "list_subdirs"]
