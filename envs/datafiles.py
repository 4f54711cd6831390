"""A user's data file as memory-mapped Arrow, its answers read as the file writes them.

``env=dataset`` (:mod:`envs.dataset`) reads every file through :func:`load`:

* **Conversion, once.** JSON Lines, JSON and CSV files are read by pyarrow's own readers,
  Parquet by its row groups, a chunk at a time (:data:`CHUNK` bytes of lines, or row batches),
  and written as one Arrow stream file into ``datasets``' cache (``polyrl-files/``, named by
  the file's path, size, modification time and the answer column asked for); the next read of
  an unchanged file maps it at once. ``.arrow`` files and ``save_to_disk`` directories are
  mapped where they lie. The result is a ``datasets.Dataset`` over the mapped file: no column
  is copied whole and no page is touched until a row is asked for.
* **Answers as written.** Arrow infers a JSON column of numbers as integers or doubles and a
  CSV column of digits as integers, which turns ``2`` into ``2.0`` beside a ``2.5``, ``007``
  into ``7`` and ``12345678901234567890`` into ``1.2345678901234567e+19``. So the answer column
  is read as text: CSV's with pyarrow's ``column_types`` (every CSV answer stays its cell's
  text); in JSON, numbers of an answer column that Arrow inferred as integers are their own
  digits, and a chunk where it inferred doubles or mixed numbers with strings has its answers
  taken from its lines' own text (Python's ``json`` with the number kept as its token). A JSON
  answer that is a boolean, a list or an object stays that value.
* **Streaming checks** (:func:`batches`): the checks read the Arrow file a batch at a time with
  plain reads (not through the mapping), so checking a file larger than memory leaves neither
  its pages nor Arrow's buffers in the process; Arrow's pool is given back afterwards.

Limits: a ``.json`` file (one JSON array) is read whole by Python's ``json`` to find its
objects (a JSON array cannot be read in pieces); use JSON Lines for large files. A column's
type is the first chunk's: a later chunk that cannot be cast to it (a column all null in the
first 2 MB and text later, numbers that become text) is an error naming its rows.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from envs.errors import EnvConfigError

INSTALL_HINT = "env=dataset needs Hugging Face datasets: pip install -e .[data]"
CONVERTED = {".jsonl", ".json", ".csv", ".parquet"}
CHUNK = 2 << 20  # bytes of a JSON or CSV file parsed at once: a larger one is faster, and
# what a run holds after reading grows with it (glibc keeps a freed heap)
BATCH_ROWS = 16_384  # Parquet rows converted at once
VERSION = "1"  # of the conversion: a change makes earlier cached files stale


class NoRows(EnvConfigError):
    """The file holds no rows (empty, or a header alone)."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise EnvConfigError(INSTALL_HINT) from e
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def load(path: Path, key: str, answer_key: str | None, answer_keys: tuple[str, ...]) -> Any:
    """``path`` as a memory-mapped ``datasets.Dataset`` (``answer_key``, or the first of
    ``answer_keys`` the file has, read as text where the file writes text or numbers)."""
    datasets = _datasets()
    try:
        if path.is_dir():
            if _no_shards(path):
                raise NoRows(f"{key}: {path} has no rows")
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if len(loaded) != 1 and "train" not in loaded:
                    raise EnvConfigError(f"{key}: {path} holds splits {', '.join(loaded)}: name "
                                         "one split's directory")
                loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
            if loaded._indices is not None:  # a save_to_disk of a selection: the rows it means
                loaded = loaded.flatten_indices()
            return loaded
        if path.suffix.lower() == ".arrow":
            return datasets.Dataset.from_file(str(path))
        target = _cached(path, answer_key)
        if not target.exists():
            _convert(path, target, key, answer_key, answer_keys)
        return datasets.Dataset.from_file(str(target))
    except EnvConfigError:
        raise
    except Exception as e:  # pyarrow's and datasets' many reader errors: one line for the user
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EnvConfigError(f"{key}: cannot read {path}: {message}") from e
    finally:
        _release()


def _no_shards(path: Path) -> bool:
    """A ``save_to_disk`` directory of no rows (``datasets`` writes no Arrow file for it)."""
    try:
        state = json.loads((path / "state.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(state, dict) and state.get("_data_files") == []


def batches(data: Any) -> Iterator[Any]:
    """A dataset's rows as Arrow record batches, read from its files (not through their
    mapping, so the pages read do not stay in the process)."""
    import pyarrow as pa

    files = [f["filename"] for f in data.cache_files]
    if not files:  # held in memory (a selection flattened): its table as it is
        yield from data.data.table.to_batches(max_chunksize=BATCH_ROWS)
        return
    for name in files:
        with pa.OSFile(name) as source:
            reader = pa.ipc.open_stream(source)
            for batch in reader:
                yield batch
                del batch
    _release()


def _release() -> None:
    """Arrow's pool keeps freed memory for reuse: hand it back after a file is read."""
    try:
        import pyarrow as pa
    except ImportError:
        return
    pa.default_memory_pool().release_unused()


def _cached(path: Path, answer_key: str | None) -> Path:
    datasets = _datasets()
    stat = path.stat()
    ident = json.dumps([VERSION, str(path.resolve()), stat.st_size, stat.st_mtime_ns, answer_key])
    name = f"{path.stem[:40]}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}.arrow"
    return Path(datasets.config.HF_DATASETS_CACHE) / "polyrl-files" / name


def _convert(path: Path, target: Path, key: str, answer_key: str | None,
             answer_keys: tuple[str, ...]) -> None:
    """``path`` written as an Arrow stream file at ``target`` (atomically: a temporary file
    renamed), a chunk at a time."""
    import pyarrow as pa

    suffix = path.suffix.lower()
    if suffix == ".csv":
        tables = _csv(path, answer_key, answer_keys)
    elif suffix == ".parquet":
        tables = _parquet(path)
    else:
        tables = _json(path, answer_key, answer_keys)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    writer = None
    rows = 0
    try:
        for table in tables:
            if writer is None:
                schema = table.schema
                writer = pa.ipc.new_stream(str(tmp), schema)
            elif table.schema != schema:
                table = _conform(table, schema, path, key, rows)
            writer.write_table(table, max_chunksize=BATCH_ROWS)
            rows += table.num_rows
        if writer is None or rows == 0:
            raise NoRows(f"{key}: {path} has no rows")
        writer.close()
        writer = None
        os.replace(tmp, target)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)


def _conform(table: Any, schema: Any, path: Path, key: str, before: int) -> Any:
    """A later chunk cast to the first chunk's columns (missing ones null)."""
    import pyarrow as pa

    columns = []
    for field in schema:
        if field.name not in table.column_names:
            columns.append(pa.nulls(table.num_rows, field.type))
            continue
        column = table.column(field.name)
        try:
            columns.append(column.cast(field.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
            raise EnvConfigError(
                f"{key}: {path} rows {before + 1}-{before + table.num_rows} key "
                f"{field.name!r}: {column.type} here, {field.type} in the file's first rows; "
                "give the column one type") from e
    extra = sorted(set(table.column_names) - set(schema.names))
    if extra:
        raise EnvConfigError(f"{key}: {path} rows {before + 1}-{before + table.num_rows} have "
                             f"a column {extra[0]!r} the file's first rows lack")
    return pa.Table.from_arrays(columns, schema=schema)


# --- CSV ----------------------------------------------------------------------------------------


def _csv(path: Path, answer_key: str | None, answer_keys: tuple[str, ...]) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(block_size=CHUNK)
    try:
        with pcsv.open_csv(str(path), read_options=read) as peek:
            names = peek.schema.names
    except pa.ArrowInvalid as e:
        if "Empty CSV file" in str(e):
            return
        raise
    answer = answer_key if answer_key is not None else next(
        (k for k in answer_keys if k in names), None)
    types = {answer: pa.string()} if answer in names else {}
    convert = pcsv.ConvertOptions(column_types=types, strings_can_be_null=True)
    with pcsv.open_csv(str(path), read_options=read, convert_options=convert) as reader:
        for batch in reader:
            yield pa.Table.from_batches([batch])


# --- Parquet ------------------------------------------------------------------------------------


def _parquet(path: Path) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with pq.ParquetFile(str(path)) as file:
        yielded = False
        for batch in file.iter_batches(batch_size=BATCH_ROWS):
            yielded = True
            yield pa.Table.from_batches([batch])
        if not yielded:  # the schema alone, for a 0-row file's one line
            return


# --- JSON ---------------------------------------------------------------------------------------


def _json(path: Path, answer_key: str | None, answer_keys: tuple[str, ...]) -> Iterator[Any]:
    answer = answer_key
    for lines in _json_chunks(path):
        if answer is None:  # the first row names the answer column the rest use
            first = json.loads(next(line for line in lines.splitlines() if line.strip()))
            answer = next((k for k in answer_keys if _dig(first, k.split(".")) is not None
                           or (isinstance(first, dict) and k in first)), None)
        yield _json_table(lines, answer)


def _json_chunks(path: Path) -> Iterator[bytes]:
    """JSON Lines in chunks of whole lines; a JSON array's objects as such lines."""
    with open(path, "rb") as file:
        head = file.read(CHUNK)
        if head.startswith(b"\xef\xbb\xbf"):
            head = head[3:]
        if head.lstrip().startswith(b"["):
            yield from _array_lines(head + file.read())
            return
        chunk = head
        while chunk:
            chunk += file.readline()
            if chunk.strip():
                yield chunk
            chunk = file.read(CHUNK)


def _array_lines(text: bytes) -> Iterator[bytes]:
    """A JSON array's items, each its own text on one line (a raw newline in JSON text is
    whitespace: inside strings it is written ``\\n``)."""
    decoder = json.JSONDecoder()
    source = text.decode("utf-8")
    index = source.index("[") + 1
    lines: list[str] = []
    size = 0
    while True:
        while index < len(source) and source[index] in " \t\r\n,":
            index += 1
        if index >= len(source) or source[index] == "]":
            break
        _, end = decoder.raw_decode(source, index)
        line = source[index:end].replace("\r", " ").replace("\n", " ")
        lines.append(line)
        size += len(line)
        index = end
        if size >= CHUNK:
            yield "\n".join(lines).encode()
            lines, size = [], 0
    if lines:
        yield "\n".join(lines).encode()


def _has(schema: Any, dotted: str) -> bool:
    import pyarrow as pa

    head, *rest = dotted.split(".")
    if head not in schema.names:
        return False
    kind = schema.field(head).type
    for part in rest:
        if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
            return False
        kind = kind.field(part).type
    return True


def _read_json(lines: bytes) -> Any:
    import pyarrow.json as paj

    block = 1 << 20
    while True:
        try:
            return paj.read_json(io.BytesIO(lines), read_options=paj.ReadOptions(block_size=block))
        except Exception as e:
            if "straddling" in str(e) and block < len(lines):
                block *= 2
                continue
            raise


def _json_table(lines: bytes, answer: str | None) -> Any:
    """A chunk of JSON Lines as a table, the answer column's numbers as their own text."""
    import pyarrow as pa

    try:
        table = _read_json(lines)
    except pa.ArrowInvalid as e:
        if answer is None or f"Column(/{answer.replace('.', '/')})" not in str(e):
            raise
        # numbers and strings in one answer column: the numbers as written, then Arrow
        table = _read_json(_numbers_as_text(lines, answer))
    if answer is None or not _has(table.schema, answer):
        return table
    column = _field(table, answer)
    if pa.types.is_integer(column.type):
        return _replace(table, answer, column.cast(pa.string()))
    if pa.types.is_floating(column.type) or pa.types.is_decimal(column.type):
        return _replace(table, answer, pa.array(_raw_answers(lines, answer), pa.string()))
    return table


def _field(table: Any, dotted: str) -> Any:
    import pyarrow.compute as pc

    head, *rest = dotted.split(".")
    column = table.column(head)
    return pc.struct_field(column, rest) if rest else column


def _replace(table: Any, dotted: str, values: Any) -> Any:
    """``table`` with the (nested) column ``dotted`` replaced by ``values``."""
    import pyarrow as pa

    head, *rest = dotted.split(".")
    index = table.column_names.index(head)
    column = table.column(head)
    if rest:
        column = _replace_in_struct(column.combine_chunks(), rest, values)
    else:
        column = values
    return table.set_column(index, pa.field(head, column.type), column)


def _replace_in_struct(struct: Any, path: list[str], values: Any) -> Any:
    import pyarrow as pa

    kind = struct.type
    children = []
    for n in range(kind.num_fields):
        child = struct.field(n)
        if kind.field(n).name == path[0]:
            child = values if len(path) == 1 else _replace_in_struct(child, path[1:], values)
        children.append(child)
    names = [kind.field(n).name for n in range(kind.num_fields)]
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    children = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in children]
    return pa.StructArray.from_arrays(children, names=names, mask=struct.is_null())


class _Raw(str):
    """A JSON number kept as its token's text."""


def _dig(value: Any, path: list[str]) -> Any:
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _raw_answers(lines: bytes, answer: str) -> list[str | None]:
    """Each line's answer as the line writes it (a number's own token)."""
    path = answer.split(".")
    out: list[str | None] = []
    for line in lines.splitlines():
        if not line.strip():
            continue
        value = _dig(json.loads(line, parse_int=_Raw, parse_float=_Raw), path)
        out.append(None if value is None else str(value))
    return out


def _numbers_as_text(lines: bytes, answer: str) -> bytes:
    """The chunk's lines with each numeric answer turned into a string of its token."""
    path = answer.split(".")
    out = []
    for line in lines.splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        raw = _dig(json.loads(line, parse_int=_Raw, parse_float=_Raw), path)
        if isinstance(raw, _Raw):
            holder = _dig(row, path[:-1])
            if isinstance(holder, dict):
                holder[path[-1]] = str(raw)
        out.append(json.dumps(row))
    return "\n".join(out).encode()
