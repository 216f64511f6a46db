"""Transformer Engine's core wheel made small enough for one device call: its CUDA kernels kept for one GPU arch.

``libtransformer_engine.so`` (343 MB) is 263 MB of ``.nv_fatbin``: one compressed cubin per kernel module for each
of sm_75, 80, 89, 90, 100, 103, 107, 120 (no PTX; measured on 2.20.2). The lent GPU machines are H100/H200
(sm_90): every cubin of another arch is zeroed in place (headers, offsets and sizes untouched, so the ELF and each
fatbin container keep their layout; the CUDA driver reads only the entry it picks for the device), after which xz
packs the library to ~23 MB instead of ~260 (deflate 272, zstd -19 --long 260). The rest of the wheel stays a zip.

    python tools/te_prune.py WHEEL OUTDIR [--keep-arch 90]
        -> OUTDIR/rest.zip (the wheel without the library), OUTDIR/libtransformer_engine.so (pruned; xz it),
           OUTDIR/prune.json (bytes kept / zeroed per arch, sha256 of the pruned library)

Fatbin container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 size of its entries; entry: u16 kind
(1 PTX, 2 cubin), u16, u32 header size, u64 payload size, ..., u32 arch at byte 28 (sm_XY -> XY).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import zipfile
from collections import Counter

FATBIN_MAGIC = 0xBA55ED50
LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"


def elf_section(buf: bytes, name: str) -> tuple:
    """(file offset, size) of section ``name`` of a little-endian ELF64 image ``buf``; ValueError if absent."""
    if buf[:4] != b"\x7fELF" or buf[4] != 2 or buf[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", buf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", buf, 0x3A)

    def header(i):   # (name offset, file offset, size) of section i
        base = shoff + i * shentsize
        return struct.unpack_from("<I", buf, base)[0], *struct.unpack_from("<QQ", buf, base + 0x18)
    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name_off, off, size = header(i)
        end = buf.index(b"\0", str_off + name_off)
        if buf[str_off + name_off:end].decode() == name:
            return off, size
    raise ValueError(f"no section {name}")


def prune_fatbin(buf: bytearray, start: int, size: int, keep_arch: int) -> Counter:
    """Zeroes, in ``buf[start:start + size]`` (a run of fatbin containers), the payload of every entry whose arch
    is not ``keep_arch``. Returns bytes per (kind, arch, "kept" | "zeroed"). ValueError on a malformed container
    or when no entry of ``keep_arch`` exists (the library would not run there)."""
    stats: Counter = Counter()
    off, end = start, start + size
    while off < end:
        magic, _, hsize, fsize = struct.unpack_from("<IHHQ", buf, off)
        if magic != FATBIN_MAGIC:
            raise ValueError(f"no fatbin container at byte {off} (magic {magic:#x})")
        e, cend = off + hsize, off + hsize + fsize
        while e < cend:
            kind, _, ehsize, psize = struct.unpack_from("<HHIQ", buf, e)
            arch, = struct.unpack_from("<I", buf, e + 28)
            keep = arch == keep_arch
            if not keep:
                buf[e + ehsize:e + ehsize + psize] = bytes(psize)
            stats[(kind, arch, "kept" if keep else "zeroed")] += psize
            e += ehsize + psize
        if e != cend:
            raise ValueError(f"fatbin container at byte {off}: entries end at {e}, the header says {cend}")
        off = cend
    if not any(k[1] == keep_arch and k[2] == "kept" for k in stats):
        raise ValueError(f"no kernel of sm_{keep_arch} in the library: nothing would run there")
    return stats


def split_wheel(wheel: str, out_dir: str, keep_arch: int = 90) -> dict:
    """``wheel`` -> out_dir/rest.zip (every member but the library) and out_dir/libtransformer_engine.so (pruned).
    Returns the summary also written to out_dir/prune.json."""
    os.makedirs(out_dir, exist_ok=True)
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(os.path.join(out_dir, "rest.zip"), "w",
                                                        zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename != LIB:
                zout.writestr(info, zin.read(info))
        lib = bytearray(zin.read(LIB))
    original = hashlib.sha256(lib).hexdigest()
    off, size = elf_section(lib, ".nv_fatbin")
    stats = prune_fatbin(lib, off, size, keep_arch)
    with open(os.path.join(out_dir, "libtransformer_engine.so"), "wb") as f:
        f.write(lib)
    summary = {"wheel": os.path.basename(wheel), "keep_arch": keep_arch, "original_sha256": original,
               "pruned_sha256": hashlib.sha256(lib).hexdigest(), "fatbin_bytes": size,
               "bytes": {f"{'cubin' if k == 2 else 'ptx' if k == 1 else k}_sm{a}_{what}": n
                         for (k, a, what), n in sorted(stats.items())}}
    with open(os.path.join(out_dir, "prune.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel")
    ap.add_argument("out_dir")
    ap.add_argument("--keep-arch", type=int, default=90, help="the GPU arch kept (sm_90: H100/H200)")
    args = ap.parse_args()
    s = split_wheel(args.wheel, args.out_dir, args.keep_arch)
    kept = sum(n for k, n in s["bytes"].items() if k.endswith("_kept"))
    print(f"te_prune: kept {kept} of {s['fatbin_bytes']} fatbin bytes (sm_{s['keep_arch']})")


if __name__ == "__main__":
    main()
