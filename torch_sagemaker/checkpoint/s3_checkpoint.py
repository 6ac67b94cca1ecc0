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
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch_sagemaker.checkpoint import integrity
from torch_sagemaker.checkpoint.atomic_dir import check_as_written
from torch_sagemaker.checkpoint.completeness import (
    inside_checkpoint_hint,
    is_complete_checkpoint,
    marker_kind,
    parts_description,
)
from torch_sagemaker.checkpoint.constants import COMPLETION_MARKER, DCP_METADATA
from torch_sagemaker.checkpoint.marker import (
    CheckpointError,
    check_sizes,
    incomplete_error,
    new_marker,
    read_marker_bytes,
)
from torch_sagemaker.checkpoint.s3_filesystem import (
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


class S3Checkpoint:
    """One checkpoint location ``s3://bucket/key``: the S3-prefix location.

    Saves follow Note [S3 checkpoint layout]; see ``location.CheckpointLocation`` for what
    each method does in the protocol.

    Args:
        uri: The checkpoint's URI.
        s3_region: The bucket's region (default: the environment's, else the bucket's).
        s3client_config: An ``s3torchconnector.S3ClientConfig`` for every client made here.
        checksums: Record and verify object checksums (Note [Checkpoint checksums]);
            ``False`` writes and checks sizes only.
        container: The location only holds checkpoints (retention's root), so it may be a
            whole bucket.

    Raises:
        ValueError: If ``uri`` names a bucket but no key (a checkpoint needs a prefix).
    """

    #: S3 streams have no file descriptor to fsync.
    syncs_files = False

    def __init__(
        self,
        uri: str,
        s3_region: str | None = None,
        s3client_config: Any = None,
        *,
        checksums: bool = True,
        container: bool = False,
    ):
        self.uri = format_s3_path(uri)
        self.bucket, self.key = parse_s3_uri(self.uri)
        if not self.key and not container:
            raise ValueError(
                f"checkpoint_id={uri!r} is a bucket; a checkpoint needs a key prefix, e.g. "
                f"s3://{self.bucket}/run/step100."
            )
        self.region = resolve_region(self.uri, s3_region)
        self.s3client_config = s3client_config
        self.checksums = checksums
        self._client: Any = None

    def __str__(self) -> str:
        return self.uri

    def __repr__(self) -> str:
        return f"S3Checkpoint({self.uri!r}, checksums={self.checksums})"

    # ---------------------------------------------------------------- naming
    @property
    def name(self) -> str:
        """The last component of the key (empty for a bucket)."""
        return self.key.rpartition("/")[2]

    def _at(self, key: str, container: bool = False) -> S3Checkpoint:
        other = S3Checkpoint(
            format_s3_path(self.bucket, key),
            self.region,
            self.s3client_config,
            checksums=self.checksums,
            container=container,
        )
        other._client = self._client  # one client for a location and those derived from it
        return other

    def child(self, name: str) -> S3Checkpoint:
        """The checkpoint ``name`` under this prefix, with the same options."""
        return self._at(f"{self.key}/{name}" if self.key else name)

    def parent(self) -> S3Checkpoint | None:
        """The prefix holding this one (the bucket at the top; ``None`` for a bucket)."""
        if not self.key:
            return None
        return self._at(self.key.rpartition("/")[0], container=True)

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
        def head() -> bool:
            try:
                self.client.head_object(self.bucket, key)
            except Exception as e:  # noqa: BLE001 - S3Exception: not found, or no access
                if "NotFound" in str(e) or "NoSuchKey" in str(e) or "not found" in str(e).lower():
                    return False
                raise
            return True

        # "Not found" is an answer; anything else (throttling, a dropped connection) is retried
        # as the other requests are.
        return retry_with_jitter(head)

    def list_objects(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of every object under ``prefix``."""

        def listing() -> dict[str, int]:
            out = {}
            for page in self.client.list_objects(self.bucket, prefix):
                out.update({o.key: o.size for o in page.object_info})
            return out

        return retry_with_jitter(listing)

    def _delete_keys(self, keys: list[str]) -> None:
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

    # ------------------------------------------------------------------ save
    def prepare(self, save_id: str) -> None:
        """Step 1 (coordinator): nothing to ready, the save's id alone names its prefix."""
        del save_id

    def write_root(self, save_id: str) -> str:
        """Where DCP writes save ``save_id``: its own prefix."""
        return self.data_uri(save_id)

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

    def storage_reader(self, marker: dict[str, Any], given: Any = None) -> Any:
        """``s3torchconnector``'s DCP reader of the committed save (ranged, coalesced reads).

        ``given`` is not used: whatever reader a caller passed, the objects read are those of
        the save the marker names (Note [S3 checkpoint layout]).
        """
        del given
        from s3torchconnector import S3ReaderConstructor
        from s3torchconnector.dcp import S3StorageReader

        # The reader sorts and coalesces each rank's byte ranges through its constructor,
        # so the file system must read through the very same constructor object.
        constructor = S3ReaderConstructor.dcp_optimized()
        reader = S3StorageReader(
            self.region,
            self.data_root(marker),
            s3client_config=self.s3client_config,
            reader_constructor=constructor,
        )
        reader.fs = self.file_system(reader_constructor=constructor)
        return reader

    # --------------------------------------------------------------- protocol
    def commit(
        self, save_id: str, info: dict[str, Any], recorded: integrity.Written | None
    ) -> None:
        """Step 3: writes the marker over the objects of ``save_id`` (the coordinator).

        Raises:
            CheckpointError: If DCP left no ``.metadata`` object, or the save lost or
                changed an object its ranks wrote (Note [Commit what was written] in
                ``integrity``).
        """
        prefix = f"{self.key}/{save_id}/"
        sizes = {k[len(prefix) :]: s for k, s in sorted(self.list_objects(prefix).items())}
        if DCP_METADATA not in sizes:
            raise CheckpointError(
                f"checkpoint {self.uri}: save {save_id} has no {DCP_METADATA} object after DCP "
                "finished; not committing it."
            )
        if recorded is not None:
            check_as_written(self.uri, f"{self.uri}/{save_id}/", sizes, recorded)
        checksums: dict[str, str] | None = None
        if self.checksums:
            checksums = {}
            for name, size in sizes.items():
                crc = integrity.recorded_checksum((recorded or {}).get(name), size)
                checksums[name] = crc if crc is not None else self.checksum(prefix + name)
        self._put(self.marker_key, new_marker(sizes, checksums, {"data": save_id, **info}))

    def remove_replaced(self, save_id: str) -> None:
        """Step 4: deletes the objects of every save id but ``save_id``."""
        stale: dict[str, list[str]] = {}
        for key in self.list_objects(f"{self.key}/"):
            first = key[len(self.key) + 1 :].split("/", 1)[0]
            if _SAVE_ID.match(first) and first != save_id:
                stale.setdefault(first, []).append(key)
        for keys in stale.values():
            self._delete_keys(keys)

    def marker_save_id(self) -> str | None:
        """The save id the marker names, if there is a readable marker."""
        try:
            return json.loads(self._get(self.marker_key)).get("data")
        except Exception:  # noqa: BLE001 - no marker, or unreadable: no committed save
            return None

    def marker_entries(self) -> dict[str, Any]:
        """The marker's fields as written (its object table unchecked); ``{}`` without one."""
        try:
            marker = json.loads(self._get(self.marker_key))
        except Exception:  # noqa: BLE001 - no marker, or unreadable
            return {}
        return marker if isinstance(marker, dict) else {}

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
                # As on a file system (``atomic_dir.read_marker``): a checkpoint saved in
                # parts, each with its marker, is of another kind, not incomplete.
                other = parts_description(self.subdirs())
                if other is not None:
                    raise CheckpointError(f"checkpoint {self.uri} {other}")
                raise incomplete_error(self.uri)
            hint = ""
            parent = self.parent()
            if parent is not None and parent.key and parent.is_complete():
                hint = inside_checkpoint_hint(parent, marker_kind(parent), self.name)
            raise CheckpointError(f"checkpoint {self.uri} does not exist.{hint}")
        source = f"s3://{self.bucket}/{self.marker_key}"

        def read() -> bytes:
            text = self._get(self.marker_key)
            save_id = json.loads(text).get("data")
            if not isinstance(save_id, str) or not _SAVE_ID.match(save_id):
                raise ValueError(f"its data id {save_id!r} is not a save id")
            return text

        marker = read_marker_bytes(read, self.uri, source)
        prefix = f"{self.key}/{marker['data']}/"
        actual = {k[len(prefix) :]: s for k, s in self.list_objects(prefix).items()}
        check_sizes(self.uri, marker["files"], actual, prefix=f"{marker['data']}/")
        return marker

    def data_root(self, marker: dict[str, Any] | None = None) -> str:
        """Where DCP reads the committed objects: the prefix of the save the marker names.

        Args:
            marker: The marker ``read_marker`` returned; read now when ``None``.
        """
        if marker is None:
            marker = self.read_marker()
        return self.data_uri(marker["data"])

    def verify(self, marker: dict[str, Any], names: list[str]) -> list[str]:
        """Problems found by re-checksumming ``names`` (``integrity.verify``), each named.

        None when checksums are off. The objects are read on up to ``VERIFY_THREADS``
        threads: an object store answers concurrent GETs in parallel, and each read is
        mostly waiting (zlib releases the GIL).
        """
        if not self.checksums:
            return []
        prefix = f"{self.key}/{marker['data']}/"
        wanted = [n for n in names if n in marker["checksums"]]
        with ThreadPoolExecutor(max_workers=max(1, min(VERIFY_THREADS, len(wanted)))) as pool:
            futures = {n: pool.submit(self.checksum, prefix + n) for n in wanted}
            problems = integrity.verify_with(
                lambda name: futures[name].result(), names, marker["checksums"]
            )
        return [f"{marker['data']}/{p}" for p in problems]

    # ------------------------------------------------------------- retention
    def subdirs(self) -> list[str]:
        """Names of the "directories" right under this prefix (key prefixes ending in ``/``)."""
        prefix = f"{self.key}/" if self.key else ""

        def listing() -> list[str]:
            names = []
            for page in self.client.list_objects(self.bucket, prefix, "/"):
                names += [p[len(prefix) :].rstrip("/") for p in page.common_prefixes]
            return sorted(names)

        return retry_with_jitter(listing)

    def checkpoint_names(self) -> set[str]:
        """The complete checkpoints right under this prefix (hidden names left out).

        A prefix without its completion marker is a save that failed or is still running
        (on a file system it would be a hidden staging directory): it does not count; one
        of per-rank parts counts once they are all complete (``completeness``).
        """
        names = [n for n in self.subdirs() if not n.startswith(".")]
        return {n for n in names if is_complete_checkpoint(self.child(n))}

    def remove(self) -> None:
        """Deletes every object of the checkpoint, completion markers first."""
        self._remove()

    def _remove(self) -> int:
        keys = sorted(self.list_objects(f"{self.key}/"))
        # Markers first: a deletion cut short must not leave a "complete" checkpoint behind.
        keys.sort(key=lambda k: not k.endswith(f"/{COMPLETION_MARKER}"))
        self._delete_keys(keys)
        return len(keys)


def list_subdirs(uri: str, s3_region: str | None = None, s3client_config: Any = None) -> list[str]:
    """Names of the "directories" right under ``uri`` (the key prefixes ending in ``/``)."""
    return S3Checkpoint(uri, s3_region, s3client_config, container=True).subdirs()


def delete_prefix(uri: str, s3_region: str | None = None, s3client_config: Any = None) -> int:
    """Deletes every object under the checkpoint ``uri``, completion markers first.

    Returns:
        The number of objects deleted.
    """
    return S3Checkpoint(uri, s3_region, s3client_config)._remove()


__all__ = ["S3Checkpoint", "delete_prefix", "list_subdirs"]
