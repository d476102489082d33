"""A harvest's prompts, read from what researchers keep datasets in: a list, JSONL, Parquet, a `datasets` folder.

Every reader hands back one Python list of prompts, each a string (tokenized
by the replica's engine, as `model.harvest` tokenizes it) or a list of token
ids (taken as is). A missing column or a row of the wrong type is an error
here, before Ray starts.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional, Sequence


def read_prompts(dataset: Any, column: Optional[str] = None, split: Optional[str] = None) -> list[Any]:
    """The prompts of `dataset`, in its row order.

    Args:
        dataset: A list of strings, of token-id lists or of dicts; a ``.jsonl``
            file (one JSON object a line); a ``.parquet`` file; a folder written
            by `datasets`' ``save_to_disk``; or a `datasets.Dataset`.
        column: The column holding each row's text or token ids. Default:
            ``"text"`` where rows are records; a list of strings or id lists needs none.
        split: The split of a `datasets.DatasetDict` folder (``"train"``).
    """
    if isinstance(dataset, (str, Path)):
        path = Path(dataset)
        if not path.exists():
            raise FileNotFoundError(f"dataset {path} does not exist: give a .jsonl or .parquet file, or a folder "
                                    f"written by datasets' save_to_disk.")
        if path.is_dir():
            return _from_hf(_load_from_disk(path, split), column, str(path))
        if path.suffix in (".jsonl", ".json"):
            return _from_jsonl(path, column)
        if path.suffix == ".parquet":
            return _from_parquet(path, column)
        raise ValueError(f"dataset {path}: streamscope reads .jsonl, .parquet and datasets' save_to_disk folders; "
                         f"convert {path.suffix or 'this file'} to one of those.")
    if _is_hf(dataset):
        return _from_hf(dataset, column, "the dataset")
    if isinstance(dataset, (list, tuple)):
        return _from_rows(list(dataset), column, "the list")
    raise TypeError(f"dataset is a {type(dataset).__name__}: give a list of prompts, a .jsonl or .parquet file, "
                    f"or a datasets.Dataset (or its save_to_disk folder).")


def fingerprint(prompts: Sequence[Any]) -> str:
    """A digest of the prompts: a resumed run must harvest the same rows in the same order."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(json.dumps(prompt).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _prompt(value: Any, row: int, where: str) -> Any:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"row {row} of {where} is an empty string: every prompt needs a token.")
        return value
    if hasattr(value, "tolist"):  # a numpy array or tensor of ids
        value = value.tolist()
    if isinstance(value, (list, tuple)) and value and all(isinstance(token, int) and not isinstance(token, bool)
                                                          for token in value):
        return list(value)
    raise TypeError(f"row {row} of {where} is a {type(value).__name__}: a prompt is a string or a non-empty "
                    f"list of token ids.")


def _from_rows(rows: list[Any], column: Optional[str], where: str) -> list[Any]:
    if rows and isinstance(rows[0], dict):
        return _from_records(rows, column or "text", where)
    if column is not None:
        raise ValueError(f"column={column!r} names a field of records, but {where} holds "
                         f"{type(rows[0]).__name__ if rows else 'nothing'}: drop column=.")
    return [_prompt(row, index, where) for index, row in enumerate(rows)]


def _from_records(rows: list[dict], column: str, where: str) -> list[Any]:
    prompts = []
    for index, row in enumerate(rows):
        if column not in row:
            raise KeyError(f"{where} has no column {column!r} (row {index} holds {', '.join(map(repr, row))}): "
                           f"pass column= one of those.")
        prompts.append(_prompt(row[column], index, where))
    return prompts


def _from_jsonl(path: Path, column: Optional[str]) -> list[Any]:
    rows = []
    with path.open() as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number} is not JSON ({error.msg}): a .jsonl file holds one "
                                     f"JSON object a line.") from None
    if rows and not isinstance(rows[0], dict):
        return _from_rows(rows, column, str(path))
    return _from_records(rows, column or "text", str(path))


def _from_parquet(path: Path, column: Optional[str]) -> list[Any]:
    import pyarrow.parquet as parquet

    column = column or "text"
    names = parquet.read_schema(path).names
    if column not in names:
        raise KeyError(f"{path} has no column {column!r}; it has {', '.join(map(repr, names))}: pass column= one "
                       f"of those.")
    values = parquet.read_table(path, columns=[column]).column(column).to_pylist()
    return [_prompt(value, index, str(path)) for index, value in enumerate(values)]


def _is_hf(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("datasets.")


def _load_from_disk(path: Path, split: Optional[str]) -> Any:
    try:
        import datasets
    except ImportError:
        raise ImportError(f"{path} is a folder: reading a datasets folder needs `pip install datasets`.") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split is None:
            raise ValueError(f"{path} holds the splits {', '.join(loaded)}: pass split= one of them.")
        if split not in loaded:
            raise KeyError(f"{path} has no split {split!r}; it has {', '.join(loaded)}.")
        return loaded[split]
    return loaded


def _from_hf(dataset: Any, column: Optional[str], where: str) -> list[Any]:
    column = column or "text"
    names = list(dataset.column_names)
    if column not in names:
        raise KeyError(f"{where} has no column {column!r}; it has {', '.join(map(repr, names))}: pass column= one "
                       f"of those.")
    return [_prompt(value, index, where) for index, value in enumerate(dataset[column])]
