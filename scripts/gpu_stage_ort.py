#!/usr/bin/env python3
"""Stage onnxruntime-gpu for the lent GPU host in two transfers instead of five.

The onnxruntime-gpu wheel is about 256 MB, four fifths of it the CUDA provider library, whose
device code is built for six GPU generations (sm_75 ... sm_120). A device call carries at most
64 MiB, so ../shared/gpu/README.md sends the wheel in five chunks, five calls of device time.
This script keeps only the machine code the host's GPU runs (sm_90 for the H100 and H200): in
every fat binary of the library's ``.nv_fatbin`` section that holds a cubin for that SM, the
payloads of the other cubins become zeros (headers, offsets and sizes stay, so the ELF file is
unchanged in layout), and the library is xz-compressed: 52 MB instead of 231 MB. A fat binary
with no cubin for that SM is left whole.

    python3 scripts/gpu_stage_ort.py stage [--wheel W] [--sm 90]   # here: fills .gpu/s1, .gpu/s2
    python3 scripts/gpu_stage_ort.py install .gpu/s1 .gpu/s2 /tmp/site   # on the GPU host

``stage`` takes the wheel from ``.gpu/c1..c5`` (../shared/gpu/prepare_ort_gpu.sh) when it is
not given, and puts the extra wheels (``.gpu/extras``: AutoCast's, see docs/benchmarks.md) and
onnxconverter-common beside the slim wheel. Send ``.gpu/s1`` in one call
(``true`` as the command is enough: the host keeps nothing, so send it in the same call chain as
the run, see docs/benchmarks.md "GPU"), and ``.gpu/s2`` with the run's call.
``install`` unpacks the slim wheel and the library into the target folder (a wheel is a zip of
site-packages' layout) and installs the extra wheels the host's Python does not already import.
"""

from __future__ import annotations

import argparse
import hashlib
import lzma
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
LIBRARY_FILE = "providers_cuda.so.xz"
#: A CUDA fat binary's container magic, and the entry kind of a cubin (1 is PTX).
FATBIN_MAGIC = 0xBA55ED50
CUBIN = 2


def elf_section(data: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of a 64-bit little-endian ELF file's section `name`."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    names_offset, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for index in range(shnum):
        header = shoff + index * shentsize
        name_at, = struct.unpack_from("<I", data, header)
        end = data.index(b"\0", names_offset + name_at)
        if data[names_offset + name_at:end].decode() == name:
            offset, size = struct.unpack_from("<QQ", data, header + 0x18)
            return offset, size
    raise SystemExit(f"no {name} section")


def _entries(data: bytes | bytearray, start: int, size: int) -> list[tuple[int, int, int, int]] | None:
    """(kind, sm, payload offset, payload size) of a fat binary's entries; None when they do not
    tile the container exactly (an unknown layout: leave it alone)."""
    position, end, entries = start, start + size, []
    while position < end:
        kind, _, header_size, payload = struct.unpack_from("<HHIQ", data, position)
        sm, = struct.unpack_from("<I", data, position + 28)
        if kind not in (1, CUBIN) or header_size < 32 or position + header_size + payload > end:
            return None
        entries.append((kind, sm, position + header_size, payload))
        position += header_size + payload
    return entries if position == end else None


def keep_only_sm(library: bytearray, sm: int) -> dict[str, int]:
    """Zero, in place, every fat-binary payload that a GPU of compute capability `sm` does not
    load: in each container that has a cubin for `sm`, all other entries. Returns byte counts."""
    offset, size = elf_section(bytes(library), ".nv_fatbin")
    counts = {"containers": 0, "zeroed": 0, "kept": 0, "left whole": 0}
    position, end = offset, offset + size
    while position + 16 <= end:
        if struct.unpack_from("<I", library, position)[0] != FATBIN_MAGIC:
            position += 8  # containers are 8-byte aligned
            continue
        header_size, fat_size = struct.unpack_from("<HQ", library, position + 6)
        entries = _entries(library, position + header_size, fat_size)
        counts["containers"] += 1
        if entries is None or not any(k == CUBIN and s == sm for k, s, _, _ in entries):
            counts["left whole"] += fat_size
        else:
            for kind, entry_sm, start, length in entries:
                if kind == CUBIN and entry_sm == sm:
                    counts["kept"] += length
                else:
                    library[start:start + length] = bytes(length)
                    counts["zeroed"] += length
        position += header_size + fat_size
    return counts


def _wheel_from_chunks(gpu: Path) -> Path:
    name = (gpu / "c5" / "ort.name").read_text().strip()
    wheel = gpu / "dl" / name
    wheel.parent.mkdir(exist_ok=True)
    with wheel.open("wb") as out:
        for part in sorted(gpu.glob("c*/part*"), key=lambda p: p.name):
            out.write(part.read_bytes())
    expected = (gpu / "c5" / "ort.sha256").read_text().split()[0]
    if hashlib.sha256(wheel.read_bytes()).hexdigest() != expected:
        raise SystemExit("the chunks do not make the wheel (sha256 differs): run "
                         "../shared/gpu/prepare_ort_gpu.sh again")
    return wheel


def stage(args: argparse.Namespace) -> int:
    gpu = REPO_ROOT / ".gpu"
    wheel = Path(args.wheel) if args.wheel else _wheel_from_chunks(gpu)
    library_dir, rest_dir = gpu / "s1", gpu / "s2"
    for folder in (library_dir, rest_dir):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as source:
        library = bytearray(source.read(PROVIDER))
        slim = rest_dir / wheel.name
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as target:
            for item in source.infolist():
                if item.filename != PROVIDER:
                    target.writestr(item, source.read(item))
    counts = keep_only_sm(library, args.sm)
    print(f"fat binaries: {counts['containers']}; sm_{args.sm} cubins kept "
          f"{counts['kept'] / 1e6:.1f} MB, other payloads zeroed {counts['zeroed'] / 1e6:.1f} MB, "
          f"left whole {counts['left whole'] / 1e6:.1f} MB")
    (library_dir / LIBRARY_FILE).write_bytes(
        lzma.compress(bytes(library), preset=9 | lzma.PRESET_EXTREME if args.extreme else 9))
    (rest_dir / "extras").mkdir()
    for extra in sorted((gpu / "extras").glob("*.whl")) + sorted((gpu / "c5").glob("*.whl")):
        shutil.copy(extra, rest_dir / "extras" / extra.name)
    for folder in (library_dir, rest_dir):
        megabytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
        print(f"{folder.relative_to(REPO_ROOT)}: {megabytes:.1f} MiB")
    return 0


def install(args: argparse.Namespace) -> int:
    library_dir, rest_dir, site = Path(args.library), Path(args.rest), Path(args.target)
    site.mkdir(parents=True, exist_ok=True)
    ort = sorted(rest_dir.glob("onnxruntime_gpu-*.whl"))
    if len(ort) != 1:
        raise SystemExit(f"expected one onnxruntime_gpu wheel in {rest_dir}, found {len(ort)}")
    with zipfile.ZipFile(ort[0]) as wheel:
        wheel.extractall(site)
    (site / PROVIDER).write_bytes(lzma.decompress((library_dir / LIBRARY_FILE).read_bytes()))
    if (rest_dir / "extras").is_dir():
        subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu_install_extras.py"),
                        str(rest_dir / "extras"), str(site)], check=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    staging = verbs.add_parser("stage")
    staging.add_argument("--wheel", help="the onnxruntime-gpu wheel (default: from .gpu/c1..c5)")
    staging.add_argument("--sm", type=int, default=90, help="compute capability kept (90: H100/H200)")
    staging.add_argument("--extreme", action="store_true", help="xz -9e (slower, a few MB smaller)")
    installing = verbs.add_parser("install")
    installing.add_argument("library")
    installing.add_argument("rest")
    installing.add_argument("target")
    args = parser.parse_args()
    return stage(args) if args.verb == "stage" else install(args)


if __name__ == "__main__":
    raise SystemExit(main())
