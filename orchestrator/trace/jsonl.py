"""How a run's JSONL streams are stored: compressed, rolled into segments, cut-tolerant.

A run writes two kinds of JSONL streams that grow with its length: its PolyTrace step records
(:mod:`orchestrator.trace.writer`) and its spans (:class:`~orchestrator.trace.recorder.Recorder`).
Both go through a :class:`SegmentWriter`: lines are compressed as they are written into one
compressed stream per *segment* file (:data:`ROLL_STEPS` train steps each, then the next file
starts), and every :meth:`~SegmentWriter.flush` (once per train step) ends a compressed block
and hands it to the operating system. A segment is finished (its frame closed, with a
checksum) when the writer rolls or closes.

What a crash leaves. Everything flushed decodes: a cut stream yields every block that was
complete, and :func:`read_lines` yields every complete line of it and skips a last line cut
short, as it does for a plain file. So a SIGKILL loses at most what was written since the last
flush — never more than the segment being written.

Codecs. ``zst`` (Zstandard, the ``zstandard`` package; the default, :data:`CODEC`) or ``gz``
(gzip, the standard library); ``none`` writes plain ``.jsonl``. Measured on the default
experiment's files (``python -m bench.rundir``; docs/run-directory.md), zstd at
level 3 made files about as small as gzip at level 6 while compressing several times faster,
so it is the default. :func:`read_lines` reads all three whatever wrote them, by the file's
suffix, and so reads the published traces (plain) and a run's files alike.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal, Protocol

Codec = Literal["zst", "gz", "none"]
CODEC: Codec = "zst"
CODECS: tuple[Codec, ...] = ("zst", "gz", "none")
LEVEL = {"zst": 3, "gz": 6}
ROLL_STEPS = 100  # train steps per segment file
SUFFIX = {"zst": ".jsonl.zst", "gz": ".jsonl.gz", "none": ".jsonl"}
_READ_BLOCK = 1 << 20


def suffix(codec: Codec) -> str:
    return SUFFIX[codec]


def strip_suffix(name: str) -> str | None:
    """``name`` without its JSONL suffix (``.jsonl``, ``.jsonl.zst``, ``.jsonl.gz``); None if it
    has none of them."""
    for s in (".jsonl.zst", ".jsonl.gz", ".jsonl"):
        if name.endswith(s):
            return name[: -len(s)]
    return None


def check_codec(codec: str) -> Codec:
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} must be one of {', '.join(CODECS)}")
    return codec  # type: ignore[return-value]


class _Compressor(Protocol):
    def compress(self, data: bytes) -> bytes: ...
    def flush(self, mode: int = ...) -> bytes: ...


def _compressor(codec: Codec) -> tuple[_Compressor, int]:
    """A fresh compressor for one segment and its flush-a-block mode."""
    if codec == "zst":
        import zstandard

        return (zstandard.ZstdCompressor(level=LEVEL["zst"], write_checksum=True).compressobj(),
                zstandard.COMPRESSOBJ_FLUSH_BLOCK)
    return zlib.compressobj(LEVEL["gz"], zlib.DEFLATED, 31), zlib.Z_SYNC_FLUSH


class CompressedFile:
    """One file written as a compressed stream (``codec`` ``zst`` or ``gz``), or plain."""

    def __init__(self, path: Path, codec: Codec, append: bool = False) -> None:
        self.path = path
        self.codec = codec
        path.parent.mkdir(parents=True, exist_ok=True)
        # Appending adds a frame (zst) or member (gz): both formats read concatenations as one.
        self._file: IO[bytes] = path.open("ab" if append else "wb")
        self._z, self._block = _compressor(codec) if codec != "none" else (None, 0)

    def write(self, text: str) -> None:
        data = text.encode()
        self._file.write(self._z.compress(data) if self._z is not None else data)

    def flush(self) -> None:
        """End a block: everything written so far decodes from the file, even if the process
        dies now (the OS keeps what was written)."""
        if self._z is not None:
            self._file.write(self._z.flush(self._block))
        self._file.flush()

    def close(self) -> None:
        if self._z is not None:
            self._file.write(self._z.flush())  # the end of the frame, with its checksum
            self._z = None
        self._file.close()


class SegmentWriter:
    """Lines into numbered segment files ``<stem>.<first>`` + suffix in ``directory``, a new
    segment every :meth:`roll`; ``first`` is a number the caller chooses (a step)."""

    def __init__(self, directory: Path, stem: str, codec: Codec = CODEC) -> None:
        self.directory = Path(directory)
        self.stem = stem
        self.codec = check_codec(codec)
        self._current: CompressedFile | None = None

    def segment_path(self, first: int) -> Path:
        return self.directory / f"{self.stem}.{first:06d}{suffix(self.codec)}"

    @property
    def open(self) -> bool:
        return self._current is not None

    def roll(self, first: int) -> None:
        """Finish the current segment and start the one numbered ``first``."""
        self.close()
        self._current = CompressedFile(self.segment_path(first), self.codec, append=True)

    def write(self, text: str) -> None:
        if self._current is None:
            raise RuntimeError(f"{self.stem}: write before roll()")
        self._current.write(text)

    def flush(self) -> None:
        if self._current is not None:
            self._current.flush()

    def close(self) -> None:
        if self._current is not None:
            self._current.close()
            self._current = None


def _chunks(f: IO[bytes]) -> Iterator[bytes]:
    while chunk := f.read(_READ_BLOCK):
        yield chunk


class _Decoder:
    """Decoded bytes of concatenated zstd frames or gzip members; a cut last one yields what
    decodes. :attr:`finished`: the stream ended at the end of a frame (not cut)."""

    def __init__(self, f: IO[bytes], codec: Codec) -> None:
        self.f = f
        self.codec = codec
        self.finished = True

    def _new(self) -> tuple[object, type[Exception]]:
        if self.codec == "zst":
            import zstandard

            return zstandard.ZstdDecompressor().decompressobj(), zstandard.ZstdError
        return zlib.decompressobj(31), zlib.error

    def __iter__(self) -> Iterator[bytes]:
        d, error = self._new()
        for chunk in _chunks(self.f):
            self.finished = False
            while chunk:
                try:
                    out = d.decompress(chunk)  # type: ignore[attr-defined]
                except error:
                    return  # a frame damaged by the crash that cut it: what came before stands
                if out:
                    yield out
                if not d.eof:  # type: ignore[attr-defined]
                    break
                self.finished = True
                chunk = d.unused_data  # type: ignore[attr-defined]
                d, error = self._new()


def _codec_of(path: Path) -> Codec:
    return "zst" if path.name.endswith(".zst") else "gz" if path.name.endswith(".gz") else "none"


def finished(path: Path) -> bool:
    """Whether a compressed file ends with a complete frame (a plain one: with a newline or
    empty), so that appending to it is safe."""
    codec = _codec_of(path)
    with path.open("rb") as f:
        if codec == "none":
            size = f.seek(0, 2)
            return size == 0 or (f.seek(size - 1) >= 0 and f.read(1) == b"\n")
        decoder = _Decoder(f, codec)
        for _ in decoder:
            pass
        return decoder.finished


def compressed(path: Path) -> bool:
    return path.name.endswith((".zst", ".gz"))


def read_lines(path: Path, cut_last: bool = True) -> Iterator[str]:
    """The lines of a plain, ``.zst`` or ``.gz`` JSONL file (each with its newline), streamed;
    a last line without its newline (a write a crash cut short) is skipped, or, with
    ``cut_last=False``, yielded as it is (a hand-written file may lack the final newline)."""
    path = Path(path)
    codec = _codec_of(path)
    with path.open("rb") as f:
        data = _chunks(f) if codec == "none" else iter(_Decoder(f, codec))
        rest = b""
        for block in data:
            rest += block
            *lines, rest = rest.split(b"\n")
            for line in lines:
                yield line.decode() + "\n"
        if rest and not cut_last:
            yield rest.decode()
