#!/usr/bin/env python3
"""Cross-check of fedshard's safetensors files with the `safetensors` package (run by
tests/io/test_safetensors_python.cpp with the Python of FEDSHARD_TEST_PYTHON).

check MANIFEST
    MANIFEST (JSON): {"file": path, "dtype": "F32" | "F16" | "F64" | "BF16",
    "metadata": {key: value}, "tensors": {name: {"shape": [...], "reference": path}}}.
    Loads the file with safetensors.numpy.load_file (safetensors.deserialize for BF16,
    which numpy lacks: the bytes are widened to f32 by a 16-bit shift) and checks that it
    holds exactly the named tensors, each with its shape and dtype, and values equal bit for
    bit to its reference (raw little-endian f32), and that its metadata has the given entries.

write MANIFEST DIR
    MANIFEST (JSON): {"tensors": {name: {"shape": [...], "dtype": "F32" | "F16" | "F64"}}}.
    Writes DIR/pretrained.safetensors with safetensors.numpy.save_file from seeded random
    values, and each tensor's values as f32 (numpy's conversion) to DIR/<name>.f32.

Exit status 0 when everything matched, 1 otherwise (what differed is printed).
"""

import json
import os
import sys

import numpy as np
import safetensors
from safetensors.numpy import load_file, save_file

NUMPY_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


def load_bf16(path):
    """name -> f32 array of a BF16 file, parsed by safetensors itself."""
    with open(path, "rb") as f:
        entries = safetensors.deserialize(f.read())
    out = {}
    for name, view in entries:
        if view["dtype"] != "BF16":
            raise ValueError(f"{name}: dtype {view['dtype']}, expected BF16")
        bits = np.frombuffer(bytes(view["data"]), dtype="<u2").astype("<u4") << 16
        out[name] = bits.view("<f4").reshape(view["shape"])
    return out


def check(manifest_path):
    with open(manifest_path) as f:
        manifest = json.load(f)
    path, dtype = manifest["file"], manifest["dtype"]
    tensors = load_bf16(path) if dtype == "BF16" else load_file(path)
    with safetensors.safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
    errors = []
    for key, value in manifest.get("metadata", {}).items():
        if metadata.get(key) != value:
            errors.append(f"metadata {key!r}: expected {value!r}, found {metadata.get(key)!r}")
    expected = manifest["tensors"]
    if set(tensors) != set(expected):
        errors.append(f"tensors: expected {sorted(expected)}, found {sorted(tensors)}")
    for name, want in expected.items():
        if name not in tensors:
            continue
        got = tensors[name]
        if list(got.shape) != want["shape"]:
            errors.append(f"{name}: shape {list(got.shape)}, expected {want['shape']}")
            continue
        if dtype != "BF16" and got.dtype != NUMPY_TYPES[dtype]:
            errors.append(f"{name}: numpy dtype {got.dtype}, expected {NUMPY_TYPES[dtype]}")
        ref = np.fromfile(want["reference"], dtype="<f4").reshape(want["shape"])
        got32 = got.astype(np.float32)
        differ = np.flatnonzero(got32.view("<u4").ravel() != ref.view("<u4").ravel())
        if differ.size:
            i = differ[0]
            errors.append(f"{name}: {differ.size} of {ref.size} values differ, first at {i}: "
                          f"{got32.ravel()[i]!r} != {ref.ravel()[i]!r}")
    for e in errors:
        print(f"check_safetensors: {path}: {e}")
    if not errors:
        print(f"check_safetensors: {path}: {len(expected)} {dtype} tensors match bit for bit")
    return 0 if not errors else 1


def write(manifest_path, out_dir):
    with open(manifest_path) as f:
        manifest = json.load(f)
    rng = np.random.default_rng(2024)
    tensors = {}
    for name, spec in manifest["tensors"].items():
        values = rng.standard_normal(spec["shape"]) * 0.3
        tensors[name] = values.astype(NUMPY_TYPES[spec["dtype"]])
        tensors[name].astype(np.float32).astype("<f4").tofile(os.path.join(out_dir, name + ".f32"))
    save_file(tensors, os.path.join(out_dir, "pretrained.safetensors"), metadata={"format": "pt"})
    print(f"check_safetensors: wrote {len(tensors)} tensors with safetensors "
          f"{safetensors.__version__}, numpy {np.__version__}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2]))
    if len(sys.argv) == 4 and sys.argv[1] == "write":
        sys.exit(write(sys.argv[2], sys.argv[3]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
