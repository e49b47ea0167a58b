"""The built-in corpus: Python standard-library source files, byte-tokenised.

Every machine that runs jaxtron has them, so the default config trains on real text with no
download. The corpus is built once into the cache directory ($JAXTRON_CACHE, default
~/.cache/jaxtron) and reused; the build is atomic, so concurrent processes never read half a file.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from jaxtron.data.indexed import write_indexed
from jaxtron.data.tokenizer import ByteTokenizer
from jaxtron.errors import DataError

BUILTIN_STDLIB = "builtin:stdlib"
SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def cache_dir() -> Path:
    return Path(os.environ.get("JAXTRON_CACHE", Path.home() / ".cache" / "jaxtron"))


def stdlib_documents(max_bytes: int):
    """Source files of the standard library in a fixed order, up to `max_bytes` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                text = (Path(dirpath) / name).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if total + len(text) > max_bytes:
                return
            total += len(text)
            yield text


def builtin_prefix(max_bytes: int) -> Path:
    """Path prefix of the built-in dataset, building it on first use."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    final = cache_dir() / f"stdlib-{version}-{max_bytes}"
    prefix = final / "tokens"
    if Path(f"{prefix}.json").is_file():
        return prefix
    tok, tmp = ByteTokenizer(), None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".building-"))
        write_indexed(tmp / "tokens", (tok.encode(t) for t in stdlib_documents(max_bytes)),
                      vocab_size=tok.vocab_size, tokenizer=tok.name, eos_id=tok.eos_id)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"cannot build the built-in corpus in {final.parent} ({err.strerror}); "
                        f"free space there or point the JAXTRON_CACHE variable at a writable "
                        "folder.") from None
    try:
        os.rename(tmp, final)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return prefix
