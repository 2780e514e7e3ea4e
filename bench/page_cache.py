# Copyright (c) the DeepSpeed ZeRO-3 fork authors.
# SPDX-License-Identifier: Apache-2.0

# DeepSpeed Team
"""The page cache of a set of files, for measuring reads from disk without root: drop the files' pages
(posix_fadvise DONTNEED after a sync), list the byte ranges a reader brought back in (mincore), and read exactly
those ranges again with `dd` for a baseline. Linux only."""

import ctypes
import ctypes.util
import mmap
import os
import shlex
import subprocess
import time

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop(paths):
    """Write back, then drop every cached page of the files: the next read of them comes from disk."""
    os.sync()  # dirty pages cannot be dropped
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_ranges(path):
    """[(offset, length)] in bytes of the file's pages now in the page cache, adjacent pages merged."""
    size = os.path.getsize(path)
    if size == 0:
        return []
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(addr), size, vector) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path}")
        finally:
            _libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    ranges, start = [], None
    for page in range(pages + 1):
        cached = page < pages and vector[page] & 1
        if cached and start is None:
            start = page
        elif not cached and start is not None:
            ranges.append((start * mmap.PAGESIZE, min(page * mmap.PAGESIZE, size) - start * mmap.PAGESIZE))
            start = None
    return ranges


def dd_seconds(ranges_by_path, streams):
    """Wall time of `dd` reading every range to /dev/null, in `streams` concurrent shells (as many as the ranks of
    the load it is compared with), the ranges dealt out to balance their bytes."""
    jobs = sorted(((length, path, offset) for path, ranges in ranges_by_path.items() for offset, length in ranges),
                  reverse=True)
    scripts, loads = [[] for _ in range(streams)], [0] * streams
    for length, path, offset in jobs:
        stream = loads.index(min(loads))
        loads[stream] += length
        scripts[stream].append(f"dd if={shlex.quote(str(path))} of=/dev/null bs=4M iflag=skip_bytes,count_bytes "
                               f"skip={offset} count={length} status=none")
    start = time.perf_counter()
    procs = [subprocess.Popen(["sh", "-ec", "\n".join(script)]) for script in scripts if script]
    codes = [proc.wait() for proc in procs]
    seconds = time.perf_counter() - start
    if any(codes):
        raise RuntimeError(f"dd failed: exit codes {codes}")
    return seconds
