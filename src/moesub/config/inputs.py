"""What the config points at on disk: model checkpoints and the local input paths.

Every local input the config names is checked at parse time (`check_input_paths`, errors name
the key) and is an input of the rule that reads it (workflow/rules/common.smk, `input_paths`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Any of these makes a checkpoint directory hold a tokenizer (what `moesub.models.load_tokenizer`
# then loads with transformers' AutoTokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_checkpoint_dir(path: str | Path, where: str) -> Path:
    """`path` is a checkpoint directory holding config.json; errors say what it is instead."""
    path = Path(path)
    if path.is_file():
        raise ValueError(
            f"{where}: {str(path)!r} is a file; give the checkpoint directory that holds it "
            f"({str(path.parent)!r})"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"{where}: checkpoint directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{where}: {str(path / 'config.json')!r} not found (not a Hugging Face checkpoint)"
        )
    return path


def has_tokenizer(path: str | Path, required: bool = False, where: str | None = None) -> bool:
    """Whether checkpoint `path` holds tokenizer files (`required`: raise if it does not,
    naming `where`, the config key, when given).

    Without them transformers may still build a tokenizer from config.json alone, with an empty
    vocabulary, and every document then tokenizes to nothing."""
    path = Path(path)
    found = any((path / f).is_file() for f in TOKENIZER_FILES)
    if required and not found:
        raise FileNotFoundError(
            f"{where + ': ' if where else ''}{str(path)!r} has no tokenizer (none of "
            f"{', '.join(TOKENIZER_FILES)}): copy the tokenizer files of the model it was trained "
            "from into the checkpoint directory"
        )
    return found


def input_paths(config: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(key, path, kind) of every local input the config names; kind: "file", "dir" or
    "checkpoint" (a Hugging Face checkpoint directory).

    Each is checked at parse time (`check_input_paths`) and is an input of the rule that reads
    it (workflow/rules/common.smk), so that editing the path re-plans that rule: Snakemake drops
    a job whose input is missing but whose outputs exist, and would silently keep old results.
    """
    out = [
        (f"models.{name}.path", spec["path"], "checkpoint")
        for name, spec in config["models"].items()
        if spec.get("path")
    ]
    source = config["streams"]["source"]
    if source["kind"] == "text":
        out += [(f"streams.source.{k}", source.get(k), "file") for k in ("path", "calib_path")]
    elif source["kind"] == "embedded":
        out.append(("streams.source.root", source.get("root"), "dir"))
    elif source["kind"] == "datasets" and _local_name(source["name"]):
        out.append(("streams.source.name", source["name"], "dir"))
    for task, spec in ((config.get("generate") or {}).get("tasks") or {}).items():
        out.append((f"generate.tasks.{task}.path", (spec or {}).get("path"), "file"))
    return [(key, str(path), kind) for key, path, kind in out if path]


def _local_name(name: str) -> bool:
    """A `datasets` source name that is a local save_to_disk directory, not a Hub name."""
    return name.startswith(("/", "./", "../", "~")) or Path(name).exists()


def check_input_paths(config: Mapping[str, Any]) -> None:
    """Every input path of the config exists and is of its kind (a checkpoint holds config.json
    and tokenizer files); errors name the key."""
    for key, path, kind in input_paths(config):
        p = Path(path).expanduser()
        if kind == "checkpoint":  # the pipeline tokenizes its streams with its tokenizer
            has_tokenizer(check_checkpoint_dir(p, key), required=True, where=key)
        elif not p.exists():
            raise FileNotFoundError(
                f"{key}: {path!r} does not exist (relative paths are relative to the directory "
                f"Snakemake runs in, {str(Path.cwd())!r})"
            )
        elif kind == "file" and not p.is_file():
            raise ValueError(f"{key}: {path!r} is a directory; give a file")
        elif kind == "dir" and not p.is_dir():
            raise ValueError(f"{key}: {path!r} is a file; give a directory")
