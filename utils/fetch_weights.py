#!/usr/bin/env python3
"""Downloads BLOOM checkpoints from the Hugging Face Hub into a weights folder, or lists it.

    utils/fetch_weights.py --weights ./checkpoints --model bloom-560m   # one model
    utils/fetch_weights.py --weights ./checkpoints                      # every known BLOOM
    utils/fetch_weights.py --weights ./checkpoints --list               # what is there

Known names (bloom-560m ... bloom, the 176B model) are BigScience models; any `org/name` repo id
works too. Each model lands in `<weights>/<name>`, where `bloom.py --weights <weights> --model
<name>` finds it. Only what generation needs is fetched: config.json, the tokenizer files, and the
safetensors weights (the .bin ones when a repo has no safetensors). An interrupted download resumes
where it stopped when run again.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script: find bloom_hpu

from bloom_hpu.checkpoint import (  # noqa: E402
    DEFAULT_WEIGHTS,
    find_checkpoints,
    missing_files,
    split_model_name,
)

KNOWN_MODELS = ("bloom-560m", "bloom-1b1", "bloom-1b7", "bloom-3b", "bloom-7b1", "bloom")
CONFIG_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
# Top-level names only: some repos also hold onnx/ or flax copies we do not want.
SAFETENSORS_FILES = ["model*.safetensors", "model.safetensors.index.json"]
BIN_FILES = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]
METADATA_TIMEOUT_S = 30


class FetchError(Exception):
    """One line for the user; the script exits with 1."""


# ---------------------------------------------------------------------------------------------
# The two Hub calls, kept tiny so that tests can replace them.


def hub_files(repo_id: str) -> dict[str, int | None]:
    """The files of a Hub model repo with their sizes in bytes."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo_id, files_metadata=True, timeout=METADATA_TIMEOUT_S)
    return {s.rfilename: s.size for s in info.siblings}


def hub_download(repo_id: str, local_dir: Path, allow_patterns: list[str]) -> None:
    """Downloads the matching files into local_dir, resuming partial files, with progress bars."""
    from huggingface_hub import snapshot_download

    snapshot_download(repo_id, local_dir=str(local_dir), allow_patterns=allow_patterns)


# ---------------------------------------------------------------------------------------------


def repo_id(model: str) -> str:
    org, name = split_model_name(model)
    return f"{org}/{name}"


def allow_patterns(files) -> list[str]:
    """What to download from a repo holding `files`: safetensors weights when it has any."""
    has_safetensors = any(fnmatch.fnmatch(f, SAFETENSORS_FILES[0]) for f in files)
    return CONFIG_FILES + (SAFETENSORS_FILES if has_safetensors else BIN_FILES)


def human_size(n: float | None) -> str:
    if n is None:
        return "? B"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _short_reason(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    # requests buries the cause ("[Errno 111] Connection refused") in a long message.
    errno = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    if errno:
        return errno.group(0).strip()
    first = text.strip().splitlines()[0]
    return first if len(first) <= 160 else first[:157] + "..."


def _hub_error(e: Exception, repo: str) -> FetchError:
    import requests
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled, RepositoryNotFoundError

    unreachable = f"cannot reach the Hugging Face Hub to fetch {repo}"
    if isinstance(e, OfflineModeIsEnabled):
        return FetchError(f"{unreachable}: offline mode is on; unset HF_HUB_OFFLINE to download")
    if isinstance(e, GatedRepoError):
        how = "accept its terms on huggingface.co, then log in with `hf auth login`"
        return FetchError(f"{repo} is gated on the Hugging Face Hub: {how}")
    if isinstance(e, RepositoryNotFoundError):
        known = ", ".join(KNOWN_MODELS)
        return FetchError(f"no model {repo} on the Hugging Face Hub (known names: {known}, or any org/name)")
    if isinstance(e, (requests.ConnectionError, requests.Timeout, ConnectionError, TimeoutError)):
        return FetchError(f"{unreachable}: {_short_reason(e)}; check your network or HF_ENDPOINT")
    if isinstance(e, HfHubHTTPError):
        return FetchError(f"the Hugging Face Hub refused {repo}: {_short_reason(e)}")
    return FetchError(f"cannot fetch {repo}: {_short_reason(e)}")


def fetch(weights: Path, model: str) -> Path:
    """Downloads `model` into `weights/<name>` and checks the result is a complete checkpoint."""
    repo = repo_id(model)
    local_dir = weights / split_model_name(model)[1]
    try:
        files = hub_files(repo)
        patterns = allow_patterns(files)
        size = sum(s or 0 for f, s in files.items() if any(fnmatch.fnmatch(f, p) for p in patterns))
        print(f"fetching {repo} ({human_size(size)}) into {local_dir}", flush=True)
        hub_download(repo, local_dir, patterns)
    except OSError as e:  # requests' and huggingface_hub's errors are OSErrors too
        if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError)) or e.errno == 28:
            raise FetchError(f"cannot write {local_dir}: {_short_reason(e)}") from None
        raise _hub_error(e, repo) from None
    except Exception as e:  # anything else the Hub client raises: still one line, no traceback
        raise _hub_error(e, repo) from None
    missing = missing_files(local_dir)
    if missing:
        raise FetchError(f"{repo} was fetched into {local_dir} but lacks {', '.join(missing)}; is it a BLOOM model?")
    return local_dir


def folder_size(folder: Path) -> int:
    # Follows symlinks: huggingface_hub's cache links snapshot files to blobs.
    # Skips huggingface_hub's .cache/ of partial downloads.
    files = (p for p in folder.rglob("*") if p.is_file() and ".cache" not in p.relative_to(folder).parts)
    return sum(p.stat().st_size for p in files)


def list_models(weights: Path) -> list[str]:
    """One line per model found in `weights`: name, size, completeness, folder."""
    found = find_checkpoints(weights)
    if not found:
        return [f"no models in {weights}"]
    width = max(len(name) for name in found)
    lines = []
    for name, folder in found.items():
        missing = missing_files(folder)
        state = "complete" if not missing else f"incomplete (missing {', '.join(missing)})"
        lines.append(f"{name:<{width}}  {human_size(folder_size(folder)):>9}  {state}  {folder}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Download BLOOM checkpoints from the Hugging Face Hub, or list those in a weights folder.",
        epilog=f"Known models: {', '.join(KNOWN_MODELS)} (bigscience/<name>); any org/name repo id is accepted too.",
    )
    parser.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS, help="weights folder (default: %(default)s)")
    parser.add_argument(
        "--model", nargs="+", metavar="NAME", help="models to fetch (default: every known model, about 400 GB in all)"
    )
    parser.add_argument("--list", action="store_true", help="list the models already in the weights folder")
    args = parser.parse_args(argv)

    try:
        if args.list:
            if not args.weights.is_dir():
                raise FetchError(f"weights folder {args.weights} does not exist")
            print("\n".join(list_models(args.weights)))
            return 0
        try:
            args.weights.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise FetchError(f"cannot create weights folder {args.weights}: {_short_reason(e)}") from None
        for model in args.model or KNOWN_MODELS:
            local_dir = fetch(args.weights, model)
            print(f"{repo_id(model)} is ready in {local_dir}", flush=True)
        return 0
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
