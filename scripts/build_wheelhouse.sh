#!/usr/bin/env bash
# Build the wheelhouse that scripts/device_check.sh installs from on a machine with no package
# registry (the GPU machine): binary wheels for a given Python and Linux platform of everything
# the check imports or builds with, except torch (the target keeps its own CUDA build).
#
#   bash scripts/build_wheelhouse.sh --device .wheelhouse/device    # the GPU image (Python 3.12)
#   bash scripts/build_wheelhouse.sh .wheelhouse/local              # this machine's Python
#   bash scripts/build_wheelhouse.sh --python-version 3.12 --glibc 2.28 --omit "numpy pandas" \
#     --lzma 8 DIR
#
# The requirements are read from pyproject.toml (build-system.requires, project.dependencies,
# the dev extra) less SKIPPED below, plus cmake and ninja (scikit-build-core's tools, which an
# offline build cannot fetch), at the versions in constraints.txt (the suite's; MOESUB_CONSTRAINTS=
# takes the newest the ranges allow). DIR/requirements.txt records them for the installing side.
# `--omit` leaves out distributions the target already has (only to keep the wheelhouse small:
# the install keeps whatever the target has that satisfies a requirement); `--device` omits
# those of the GPU image. `--lzma MIB` recompresses the wheels over MIB MiB with LZMA (pip reads
# them; polars and duckdb shrink by 40%) so that the wheelhouse fits the device tool's 64 MiB
# transfer; `--device` sets 8. Needs network here; the wheelhouse is rebuilt from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

# Not needed by the device check: torch (never replaced: the target's CUDA build stays), the
# pipeline runner and its SLURM plugin, datasets (imported lazily, only to download corpora),
# the linters.
SKIPPED="torch snakemake snakemake-executor-plugin-slurm datasets ruff snakefmt"
# Distributions the GPU image ('cuda', Python 3.12.3, read 2026-11-17) already has among this
# wheelhouse's requirements and their dependencies. The small build and test tools (nanobind,
# scikit-build-core, ninja, pytest, hypothesis and theirs) travel even so: a few hundred KiB
# each, in case the image's are older than pyproject.toml asks.
DEVICE_IMAGE_HAS="numpy transformers tokenizers safetensors pyarrow pandas scipy matplotlib
  seaborn jinja2 markupsafe tqdm pyyaml cmake huggingface-hub filelock fsspec hf-xet httpx
  httpcore h11 anyio idna certifi click shellingham typer rich markdown-it-py mdurl regex requests
  urllib3 charset-normalizer typing-extensions python-dateutil six contourpy cycler fonttools
  kiwisolver pillow pyparsing pygments"

usage() { sed -n '2,/^set /{/^#/p}' "$0" >&2; exit 2; }
PYVER=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
GLIBC=$(python3 -c 'import platform; print(platform.libc_ver()[1])')
OMIT=""
LZMA_MIB=""
DEST=""
while [ $# -gt 0 ]; do
  case $1 in
    --device) PYVER=3.12 GLIBC=2.28 OMIT="$DEVICE_IMAGE_HAS" LZMA_MIB=8; shift ;;
    --python-version) PYVER=$2; shift 2 ;;
    --glibc) GLIBC=$2; shift 2 ;;
    --omit) OMIT="$OMIT $2"; shift 2 ;;
    --lzma) LZMA_MIB=$2; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "build_wheelhouse: unknown option $1" >&2; usage ;;
    *) [ -z "$DEST" ] || usage; DEST=$1; shift ;;
  esac
done
[ -n "$DEST" ] || usage
if ! [[ $GLIBC =~ ^2\.[0-9]+$ ]]; then
  echo "build_wheelhouse: --glibc wants 2.N, got '$GLIBC'" >&2
  exit 2
fi

# pip matches a manylinux tag exactly: list every one the target's glibc runs.
PLATFORMS=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64
  --platform manylinux2014_x86_64)
for ((n = 5; n <= ${GLIBC#2.}; n++)); do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done

TMP="$DEST.tmp"
rm -rf "$TMP"
mkdir -p "$TMP"
python3 - "$SKIPPED" > "$TMP/requirements.txt" <<'PYEOF'
import re, sys, tomllib

project = tomllib.load(open("pyproject.toml", "rb"))
reqs = (project["build-system"]["requires"] + project["project"]["dependencies"]
        + project["project"]["optional-dependencies"]["dev"] + ["cmake", "ninja"])
skipped = set(sys.argv[1].split())
for req in reqs:
    if re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower() not in skipped:
        print(req)
PYEOF

echo "build_wheelhouse: Python $PYVER, manylinux up to glibc $GLIBC -> $DEST"
CONSTRAINTS=${MOESUB_CONSTRAINTS-constraints.txt}
PINNED=()
[ -z "$CONSTRAINTS" ] || PINNED=(-c "$CONSTRAINTS")
download() {
  python3 -m pip download -q --only-binary=:all: --implementation cp --python-version "$PYVER" \
    "${PLATFORMS[@]}" "${PINNED[@]}" -d "$TMP" "$@"
}
# A requirement that depends on torch (accelerate) would make pip fetch a multi-GB torch and its
# CUDA libraries: such a requirement is fetched alone (--no-deps) and only its other
# dependencies are resolved, with the rest.
download --no-deps -r "$TMP/requirements.txt"
python3 - "$TMP" > "$TMP/resolve.txt" <<'PYEOF'
import re, sys, zipfile
from pathlib import Path

def name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0]).lower()

tmp = Path(sys.argv[1])
needs = {}  # distribution -> its unconditional Requires-Dist
for whl in tmp.glob("*.whl"):
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    dist = name(re.search(r"^Name: (.+)$", text, re.M).group(1))
    reqs = re.findall(r"^Requires-Dist: (.+)$", text, re.M)
    needs[dist] = [r for r in reqs if "extra ==" not in r]
for req in (tmp / "requirements.txt").read_text().split("\n"):
    if not req:
        continue
    deps = needs.get(name(req), [])
    if any(name(d) == "torch" for d in deps):
        print(*(d for d in deps if name(d) != "torch"), sep="\n")
    else:
        print(req)
PYEOF
download -r "$TMP/resolve.txt"
rm "$TMP/resolve.txt"
# the installing side's fallback (--no-deps) would install two versions of one distribution
twice=$(ls "$TMP" | grep '\.whl$' | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
if [ -n "$twice" ]; then
  echo "build_wheelhouse: two versions downloaded of: $twice; pin one in pyproject.toml" >&2
  exit 1
fi

# Drop what the target has (and torch, had a dependency pulled it in anyway): wheel file names
# carry the distribution name with '-', '.' and '_' folded to '_'.
norm() { echo "$1" | tr 'A-Z.-' 'a-z__'; }
for whl in "$TMP"/*.whl; do
  name=$(norm "$(basename "$whl" | cut -d- -f1)")
  for drop in $OMIT torch triton; do
    if [ "$name" = "$(norm "$drop")" ] || [[ $name == nvidia_* ]]; then
      rm "$whl"
      break
    fi
  done
done

if [ -n "$LZMA_MIB" ]; then
  python3 - "$TMP" "$LZMA_MIB" <<'PYEOF'
import os, sys, zipfile
from multiprocessing import Pool
from pathlib import Path

def recompress(whl: Path) -> str:
    # RECORD hashes the files, not the archive: the recompressed wheel stays valid.
    tmp = whl.with_suffix(".lzma")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_LZMA) as dst:
        for info in src.infolist():
            data = src.read(info)
            info.compress_type = zipfile.ZIP_LZMA
            dst.writestr(info, data)
    before = whl.stat().st_size
    os.replace(tmp, whl)
    return f"  lzma: {whl.name} {before / 2**20:.0f} -> {whl.stat().st_size / 2**20:.0f} MiB"

big = [w for w in Path(sys.argv[1]).glob("*.whl") if w.stat().st_size > float(sys.argv[2]) * 2**20]
with Pool(max(1, min(len(big), os.cpu_count() or 1))) as pool:
    print(*pool.map(recompress, big), sep="\n")
PYEOF
fi

rm -rf "$DEST"
mv "$TMP" "$DEST"
ls -1 "$DEST"/*.whl | xargs -n1 basename
du -sh "$DEST" | sed 's/\s.*/ in all/'
