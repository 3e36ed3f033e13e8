"""The dead-letter copy of a refused record, and how it shrinks until Kafka takes it.

A refused record goes to the dead-letter topic with as much of it as fits: first whole (key,
value, its headers and the ``cdc_relay.*`` metadata), then without the value, then without its
headers, and last as metadata only (no key, metadata values cut short). Each step records what it
dropped and how large it was (``cdc_relay.value_size``, ``cdc_relay.headers_size``, ...), so the
copy still says which row it stands for; the row itself is still in the outbox table. The
metadata is never dropped, only cut: what must survive every form (the relay's
``cdc_relay.position``, by which a start knows the copy for its own) belongs there.
"""

from __future__ import annotations

from dataclasses import dataclass

ERROR_HEADER = "cdc_relay.error"  # the first metadata header of every dead-letter record
METADATA_VALUE_LIMIT = 512  # bytes of each metadata value in the metadata-only form


def header_name_ok(name: object) -> bool:
    """A name librdkafka can take: a str that is UTF-8 encodable (no lone surrogate), no NUL."""
    if not isinstance(name, str) or "\x00" in name:
        return False
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return True


def text_bytes(text: str) -> bytes:
    """UTF-8 of any str, a lone surrogate included (as its escape): metadata never fails."""
    return text.encode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class DeadLetter:
    """One dead-letter record: the refused record's parts and the ``cdc_relay.*`` metadata."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]  # the refused record's own, all with producible names
    metadata: list[tuple[str, bytes]]  # starts with ERROR_HEADER
    stage: str = "whole"

    @classmethod
    def of(
        cls,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        metadata: list[tuple[str, bytes]],
    ) -> DeadLetter:
        """A dead letter for a refused record, leaving out headers librdkafka cannot take."""
        kept = [(name, value) for name, value in headers if header_name_ok(name)]
        if len(kept) != len(headers):
            metadata = [
                *metadata,
                ("cdc_relay.invalid_headers", str(len(headers) - len(kept)).encode()),
            ]
        return cls(key, value, kept, metadata)

    @classmethod
    def split(
        cls, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]
    ) -> DeadLetter:
        """The dead letter a produced header list came from (its metadata starts at the last
        ERROR_HEADER: a refused record may carry a header of that name itself)."""
        start = max((i for i, (name, _) in enumerate(headers) if name == ERROR_HEADER), default=0)
        metadata = headers[start:]
        stage = next((v.decode() for n, v in metadata if n == "cdc_relay.dropped"), "whole")
        return cls(key, value, headers[:start], metadata, stage)

    @property
    def all_headers(self) -> list[tuple[str, bytes]]:
        return [*self.headers, *self.metadata]

    @property
    def metadata_only(self) -> bool:
        return self.stage == "metadata"

    def smaller(self) -> DeadLetter | None:
        """The next smaller form, or None when this is already metadata only."""
        if self.value:
            return self._dropping("value", [("cdc_relay.value_size", len(self.value))])
        if self.headers:
            size = sum(len(text_bytes(name)) + len(value) for name, value in self.headers)
            return self._dropping(
                "headers",
                [("cdc_relay.headers_size", size), ("cdc_relay.headers_count", len(self.headers))],
            )
        if self.metadata_only:
            return None
        metadata = [
            (name, value[:METADATA_VALUE_LIMIT])
            for name, value in self.metadata
            if name != "cdc_relay.dropped"
        ]
        if self.key:
            metadata.append(("cdc_relay.key_size", str(len(self.key)).encode()))
        metadata.append(("cdc_relay.dropped", b"metadata"))
        return DeadLetter(None, None, [], metadata, "metadata")

    def _dropping(self, what: str, sizes: list[tuple[str, int]]) -> DeadLetter:
        """Without the value (and, for ``headers``, without the headers too)."""
        metadata = [(name, value) for name, value in self.metadata if name != "cdc_relay.dropped"]
        metadata += [(name, str(size).encode()) for name, size in sizes]
        stage = what if self.stage == "whole" else f"{self.stage},{what}"
        metadata.append(("cdc_relay.dropped", stage.encode()))
        headers = [] if what == "headers" else self.headers
        return DeadLetter(self.key, None, headers, metadata, stage)
