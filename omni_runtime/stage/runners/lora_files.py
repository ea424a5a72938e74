"""What a LoRA adapter file must be before any loader sees it: one ``.safetensors`` file, within
the size limit, whose header we parse ourselves.

diffusers' ``load_lora_weights`` picks a file in a folder by itself and, for any name that does not
end in ``.safetensors``, falls back to ``torch.load`` (a pickle). So the stage never lets it choose:
:func:`adapter_file` resolves a request's path to exactly one ``.safetensors`` file and checks it,
and the loader is handed that file by name. The checks, cheapest first, read nothing past the
header, so a hostile file (a 3 GiB blob, a pickle, zeros) is refused in milliseconds:

1) the size (``os.stat``) is at most ``engine_args.max_lora_file_mb``;
2) the first 8 bytes, a little-endian header length, fit in the file and in :data:`MAX_HEADER_BYTES`;
3) the header is a JSON object of tensors (``dtype``, ``shape``, ``data_offsets``) whose byte ranges
   lie in the file and match their shape and dtype, plus an optional ``__metadata__`` of strings.

:func:`check_finite` then reads the tensors one at a time (memory-mapped) and refuses NaN or
infinite weights, which would otherwise turn every image black without an error.

Runs in the stage worker's forward thread, like the rest of :mod:`omni_runtime.stage.runners.lora`.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from omni_runtime.exceptions import LoraFormatError

#: The name diffusers gives an adapter's weights in a folder (``save_lora_weights``).
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
SUFFIX = ".safetensors"
#: Largest header accepted (the safetensors format's own limit): a longer one is not an adapter.
MAX_HEADER_BYTES = 100 * 2**20
#: Bytes per element of each safetensors dtype.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}


def adapter_file(path: str, max_bytes: int, field: str) -> str:
    """The real path of the one ``.safetensors`` file ``path`` names (itself, or in a folder
    ``pytorch_lora_weights.safetensors`` or else its only ``.safetensors`` file), checked by
    :func:`check_header`. LoraFormatError (a 400) naming ``field`` and the path otherwise."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        if os.path.isfile(os.path.join(real, WEIGHT_NAME)):
            real = os.path.join(real, WEIGHT_NAME)
        else:
            found = sorted(n for n in os.listdir(real) if n.endswith(SUFFIX) and os.path.isfile(os.path.join(real, n)))
            if len(found) != 1:
                raise LoraFormatError(
                    f"{path!r} holds {'no' if not found else len(found)} .safetensors files and no {WEIGHT_NAME}: "
                    "name the adapter's file (LoRA adapters load from safetensors only)",
                    param=field,
                )
            real = os.path.join(real, found[0])
    elif not real.endswith(SUFFIX):
        raise LoraFormatError(
            f"{path!r} is not a .safetensors file: LoRA adapters load from safetensors only (never a pickle)",
            param=field,
        )
    check_header(real, max_bytes, field)
    return real


def check_header(path: str, max_bytes: int, field: str) -> None:
    """Refuse ``path`` unless it is a well-formed safetensors file of at most ``max_bytes``;
    reads its first 8 bytes and its header, nothing else."""

    def refuse(why: str) -> LoraFormatError:
        return LoraFormatError(f"{path!r} is not a safetensors LoRA adapter: {why}", param=field)

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        # 1) Size, before a byte is read.
        if size > max_bytes:
            raise LoraFormatError(
                f"{path!r} is {size / 2**20:.0f} MiB, over the {max_bytes / 2**20:.0f} MiB limit "
                "(engine_args.max_lora_file_mb)",
                param=field,
            )
        # 2) The header's length.
        head = f.read(8)
        if len(head) < 8:
            raise refuse(f"{size} bytes, shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise refuse(f"a header length of {length} bytes does not fit a {size}-byte file")
        raw = f.read(length)
    # 3) The header itself.
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise refuse(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    data_bytes = size - 8 - length
    tensors = 0
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise refuse("`__metadata__` is not a map of strings")
            continue
        tensors += 1
        _check_entry(key, info, data_bytes, refuse)
    if not tensors:
        raise refuse("it holds no tensors")


def _check_entry(key: str, info: object, data_bytes: int, refuse) -> None:
    if not isinstance(info, dict):
        raise refuse(f"tensor {key[:80]!r} is not described by an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise refuse(f"tensor {key[:80]!r} has dtype {str(dtype)[:20]!r}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise refuse(f"tensor {key[:80]!r} has shape {str(shape)[:80]}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(n) is int for n in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_bytes
    ):
        raise refuse(f"tensor {key[:80]!r} has data_offsets {str(offsets)[:80]} outside its {data_bytes} data bytes")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise refuse(f"tensor {key[:80]!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of {dtype}")


def check_finite(path: str, field: str) -> None:
    """Refuse an adapter with a NaN or infinite weight (it would make every image black, silently).
    Reads one tensor at a time from a memory map; :func:`check_header` has passed."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        names = f.keys()
        for key in names:
            tensor = f.get_tensor(key)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise LoraFormatError(
                    f"{path!r} is not a usable LoRA adapter: tensor {key[:120]!r} holds NaN or infinite values",
                    param=field,
                )
