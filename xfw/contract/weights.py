"""Neutral weight files: safetensors read and written with numpy alone, no framework.

The canonical names are the PyTorch side's parameter names (transformers / diffusers, as the
xfw_torch family builds the model), with Linear weights laid out [out, in]. Each adapter maps
its own names and layouts onto these (the Paddle side transposes its [in, out] Linear weights)::

    save_file({"lm_head.weight": np.zeros((8, 4), np.float32)}, "w/model.safetensors")
    list_tensors("w/model.safetensors")   # {"lm_head.weight": ("F32", (8, 4))}, header only
    load_file("w/model.safetensors")      # {"lm_head.weight": array(...)}
    ckpt = Checkpoint("w", family="llava")   # a model.weights directory, names made canonical
    ckpt.shapes(lora=False); ckpt.load(ckpt.names(lora=True))

A ``model.weights`` directory is an xfw export or a Hugging Face checkpoint directory
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``). Names written by
older transformers, and LoRA adapters, are mapped to the canonical names by ``xfw.contract.hf_names``.

Format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header
length N, N bytes of JSON ``{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__":
{str: str}}``, then the raw little-endian bytes, offsets relative to the end of the header.
bf16 has no numpy dtype: it is read and written as its raw uint16 bits.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from xfw.contract import hf_names

WEIGHTS_FILE = "model.safetensors"  # the file name Hugging Face checkpoints use
INDEX_FILE = "model.safetensors.index.json"  # sharded Hugging Face checkpoints
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the reference implementation's limit

# safetensors dtype name -> numpy dtype (little-endian). BF16 is carried as raw uint16 bits.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4",
          "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_NAMES = {np.dtype(v).str: k for k, v in DTYPES.items() if k != "BF16"}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
"""What a parameter may be stored as: any float converts to the model's dtype by value; an integer
type would be bytes reinterpreted (F32 bits read as I32 load as numbers like 1e9)."""


class WeightsError(ValueError):
    """A weight file that cannot be read or written; the message names the file."""


def _dtype_name(array: np.ndarray, bf16: bool) -> str:
    if bf16:
        if array.dtype != np.uint16:
            raise WeightsError(f"bf16 tensors are written from their uint16 bits, got {array.dtype}")
        return "BF16"
    key = array.dtype.str.replace(">", "<")  # written little-endian whatever the host order
    if key not in _NAMES:
        raise WeightsError(f"dtype {array.dtype} has no safetensors name")
    return _NAMES[key]


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, *, bf16: set[str] = frozenset(),
              metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` atomically (a temporary file, then a rename). Names in
    ``bf16`` are uint16 arrays holding bfloat16 bits."""
    path = Path(path)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])  # tobytes() writes C order; ascontiguousarray would make 0-d 1-d
        dtype = _dtype_name(array, name in bf16)
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # pad so the data starts 8-byte aligned, as the reference does
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for chunk in chunks:
            f.write(chunk)
    os.replace(tmp, path)


def _read_header(f, path: Path) -> tuple[dict, int]:
    head = f.read(8)
    if len(head) != 8:
        raise WeightsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER_BYTES:
        raise WeightsError(f"{path}: not a safetensors file (header length {size} bytes)")
    raw = f.read(size)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise WeightsError(f"{path}: not a safetensors file (its header is not JSON)") from None
    if len(raw) != size or not isinstance(header, dict):
        raise WeightsError(f"{path}: not a safetensors file (truncated or malformed header)")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if (not isinstance(entry, dict) or entry.get("dtype") not in DTYPES
                or not _naturals(entry.get("shape")) or not _naturals(entry.get("data_offsets"), length=2)):
            raise WeightsError(f"{path}: tensor {name!r} has a malformed header entry {str(entry)[:200]}")
    return header, 8 + size


def _naturals(value, length: int | None = None) -> bool:
    """A list of non-negative integers (``length`` long when given); bools and strings are not."""
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))


def list_tensors(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{name: (dtype, shape)}`` from the header alone (no tensor data is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header, _ = _read_header(f, path)
    except OSError as err:
        raise WeightsError(f"{path}: cannot read ({err.strerror})") from None
    return {n: (e["dtype"], tuple(e["shape"])) for n, e in header.items()}


def load_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor in ``path`` as a numpy array (BF16 as uint16 bits)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            header, start = _read_header(f, path)
            data = f.read()
    except OSError as err:
        raise WeightsError(f"{path}: cannot read ({err.strerror})") from None
    out = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        dtype = np.dtype(DTYPES[e["dtype"]])
        count = int(np.prod(e["shape"], dtype=np.int64))
        if not 0 <= begin <= end <= len(data) or end - begin != count * dtype.itemsize:
            raise WeightsError(f"{path}: tensor {name!r} data offsets {[begin, end]} do not fit its shape "
                               f"{e['shape']} or the file ({start + len(data)} bytes)")
        out[name] = np.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(e["shape"]).copy()
    return out


def check_shapes(names_shapes: dict[str, tuple[int, ...]], listed: dict[str, tuple[int, ...]],
                 path: str | os.PathLike) -> None:
    """Strict match of a model's ``{canonical name: shape}`` against a file's ``{name: shape}``: every name
    present, none extra, shapes equal. Raises one WeightsError summarising every mismatch (``path`` names the file)."""
    listed = {n: ("", tuple(s)) for n, s in listed.items()}
    missing = sorted(set(names_shapes) - set(listed))
    extra = sorted(set(listed) - set(names_shapes))
    shapes = sorted(n for n in set(names_shapes) & set(listed) if tuple(names_shapes[n]) != listed[n][1])
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameters missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unexpected tensors (e.g. {extra[0]})")
    if shapes:
        n = shapes[0]
        problems.append(f"{len(shapes)} shapes differ (e.g. {n}: model {list(names_shapes[n])}, "
                        f"file {list(listed[n][1])})")
    if problems:
        raise WeightsError(f"model.weights: {path} does not fit the model: {'; '.join(problems)}")


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 (its uint16 bits) widened exactly to float32: the upper half of a float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


class Checkpoint:
    """A ``model.weights`` directory read under the canonical names of ``family``: one file or
    Hugging Face shards, older transformers names mapped (``xfw.contract.hf_names``). bf16 tensors are
    returned as float32 (exact); the adapters cast to their parameters' dtype."""

    def __init__(self, directory: str | os.PathLike, *, family: str):
        self.directory = Path(directory)
        self.family = family
        self._where: dict[str, tuple[Path, str]] = {}  # canonical -> (file, name in it)
        self._header: dict[str, tuple[str, tuple[int, ...]]] = {}
        for path in self.files():
            listed = list_tensors(path)
            try:
                renamed = hf_names.canonical_names(family, listed)
            except ValueError as err:
                raise WeightsError(f"model.weights: {path}: {err}") from None
            for name, canon in renamed.items():
                if canon in self._where:
                    raise WeightsError(f"model.weights: {canon!r} is in both {self._where[canon][0]} and {path}")
                self._where[canon] = (path, name)
                self._header[canon] = listed[name]

    def files(self) -> list[Path]:
        single, index = self.directory / WEIGHTS_FILE, self.directory / INDEX_FILE
        if single.is_file():
            return [single]
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return [self.directory / f for f in sorted(set(weight_map.values()))]
            except (ValueError, KeyError, TypeError, AttributeError):
                raise WeightsError(f"model.weights: {index} has no weight_map of tensor -> file") from None
        raise WeightsError(f"model.weights: {self.directory} holds no {WEIGHTS_FILE} (nor {INDEX_FILE})")

    def names(self, *, lora: bool | None = None) -> list[str]:
        """Canonical names, all or only the LoRA adapters' (``lora=True``) or the rest (False)."""
        return [n for n in self._header if lora is None or hf_names.is_lora(n) == lora]

    def check_stage(self, stage: str) -> None:
        """LoRA adapters belong to a LoRA stage only: a file holding them for another stage is an error."""
        adapters = self.names(lora=True)
        if adapters and stage != "lora":
            raise WeightsError(f"model.weights: {self.directory} holds LoRA adapters (e.g. {adapters[0]}) "
                               f"but the stage is {stage!r}")

    def shapes(self, *, lora: bool | None = None) -> dict[str, tuple[int, ...]]:
        return {n: self._header[n][1] for n in self.names(lora=lora)}

    def check(self, names_shapes: dict[str, tuple[int, ...]], *, lora: bool) -> None:
        """Strict match of the model's base (or LoRA) parameters against the directory's: the same
        names and shapes, and every tensor stored as a float type (:data:`FLOAT_DTYPES`)."""
        check_shapes(names_shapes, self.shapes(lora=lora), self.directory)
        wrong = [n for n in names_shapes if self._header[n][0] not in FLOAT_DTYPES]
        if wrong:
            path = self._where[wrong[0]][0]
            more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
            raise WeightsError(f"model.weights: {path}: tensor {wrong[0]!r}{more} is stored as "
                               f"{self._header[wrong[0]][0]}, the model's parameter is floating point "
                               f"(expected one of {', '.join(FLOAT_DTYPES)})")

    def load(self, names) -> dict[str, np.ndarray]:
        """``{canonical name: array}`` for ``names`` (each file read once)."""
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._where[n][0], []).append(n)
        out = {}
        for path, wanted in by_file.items():
            state = load_file(path)
            for n in wanted:
                array = state[self._where[n][1]]
                out[n] = bf16_to_float32(array) if self._header[n][0] == "BF16" else array
        return out


SAMPLE_BYTES = 1 << 20


def fingerprint(directory: str | os.PathLike) -> str:
    """A short digest naming a checkpoint directory's content without reading all of it (14 GB for a
    7B model): for every weight file, its name, size, safetensors header, and its first and last MiB.
    Two directories with the same digest hold the same tensors but for a change inside the data that
    keeps every size and both ends (a partial in-place edit); a copy of a checkpoint keeps its digest."""
    import hashlib

    digest = hashlib.sha256()
    directory = Path(directory)
    files = sorted(p for p in directory.iterdir() if p.suffix == ".safetensors" or p.name == INDEX_FILE)
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(SAMPLE_BYTES))
            if size > 2 * SAMPLE_BYTES:
                f.seek(size - SAMPLE_BYTES)
                digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]
