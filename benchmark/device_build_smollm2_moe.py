"""Rebuild the MoEfied SmolLM2 and its AP checkpoint on another machine, bit for bit (docs/trained-model.md).

Here (the machine that holds the builds):

    python benchmark/device_build_smollm2_moe.py prepare --sizes 8M,6M,24M,rest [--payload-sizes 32M,rest]

writes .carry/smollm2/ (gitignored):

    gguf/part-000 ...         the GGUF split into pieces of the given sizes (MiB with M, KiB with K, "rest")
    recipe/recipe.json        `pagedweight moefy-recipe` of the MoE build (written once into ~/.cache if absent)
    recipe/payload-part-000   its payload.bin.xz, split by --payload-sizes (default one piece)
    calibration/<file>.json   a copy of the AP checkpoint's calibration file
    expected.json             sha256 of the GGUF, the MoE model.safetensors, the AP shard(s), the AP manifest
                              and the calibration copy, plus the convert options

There (the device; only the carried folder and the installed project are needed):

    python benchmark/device_build_smollm2_moe.py build --carry .carry/smollm2 --out /tmp/smollm2 [--workers N]

(a) joins gguf/part-* in sorted order and checks its sha256, (b) rebuilds OUT/moe with `pagedweight moefy
--recipe` and checks model.safetensors, (c) runs `pagedweight convert` with --workers N (default: all cores)
into OUT/ap and checks every AP shard and manifest.json; only then is the calibration file copied next to
the manifest, after checking its own sha256 and that its AP identity (table kind, bit range, config hash)
is the manifest's. The calibration loader itself binds a file only by that identity, not by the weights, so
the shard check is what makes the copied statistics valid. (d) prints the timings as JSON. Any mismatch
exits non-zero and names the file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pagedweight.format.checkpoint import sha256_file

HOME_CACHE = Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight"))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERT_OPTIONS = ["--table-kind", "bcq", "--bits-min", "2", "--bits-max", "8", "--group-size", "32", "--seed", "0"]
PAYLOAD_NAME = "payload.bin.xz"


def parse_sizes(text: str) -> list[int | None]:
    """'8M,6M,24M,rest' -> [8 MiB, 6 MiB, 24 MiB, None]; None (only last) takes what is left."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes: list[int | None] = []
    parts = [p.strip() for p in text.split(",") if p.strip()]
    for index, part in enumerate(parts):
        if part == "rest":
            if index != len(parts) - 1:
                raise SystemExit(f"'rest' must be the last size in {text!r}")
            sizes.append(None)
            continue
        unit = units.get(part[-1].upper(), 1)
        number = part[:-1] if part[-1].upper() in units else part
        if not number.isdigit() or int(number) <= 0:
            raise SystemExit(f"bad size {part!r} in {text!r}; use e.g. 8M,6M,24M,rest")
        sizes.append(int(number) * unit)
    return sizes


def split_file(path: Path, sizes: list[int | None], out_dir: Path, prefix: str) -> list[Path]:
    """Write path in pieces out_dir/<prefix>000, 001, ...; the sizes must cover the file exactly."""
    total = path.stat().st_size
    fixed = sum(s for s in sizes if s is not None)
    if (None in sizes and fixed >= total) or (None not in sizes and fixed != total):
        raise SystemExit(f"sizes {sizes} do not cover {path} ({total} bytes); end with 'rest'")
    out_dir.mkdir(parents=True, exist_ok=True)
    pieces = []
    with open(path, "rb") as source:
        for index, size in enumerate(sizes):
            piece = out_dir / f"{prefix}{index:03d}"
            piece.write_bytes(source.read() if size is None else source.read(size))
            pieces.append(piece)
    return pieces


def join_pieces(pieces: list[Path], target: Path) -> None:
    with open(target, "wb") as out:
        for piece in pieces:
            with open(piece, "rb") as source:
                shutil.copyfileobj(source, out, 1 << 22)


def pagedweight(*args: str) -> None:
    command = [sys.executable, "-m", "pagedweight.cli", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


# ------------------------------------------------------------------------------------------------ prepare
def prepare(args: argparse.Namespace) -> int:
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    gguf, model, ap = args.gguf, args.model, args.ap
    recipe = args.recipe
    if not (recipe / "recipe.json").is_file():
        pagedweight("moefy-recipe", "--model", str(model), "--gguf", str(gguf), "--out", str(recipe))
    recipe_record = json.loads((recipe / "recipe.json").read_text())
    expected = {
        "gguf": {"name": GGUF_NAME, "sha256": sha256_file(gguf)},
        "moe_weights": {"sha256": sha256_file(model / "model.safetensors")},
        "convert_options": CONVERT_OPTIONS,
    }
    if recipe_record["weights"]["sha256"] != expected["moe_weights"]["sha256"]:
        raise SystemExit(f"{recipe} was made from another build than {model}; delete it to write a new one")
    if recipe_record["gguf"]["sha256"] != expected["gguf"]["sha256"]:
        raise SystemExit(f"{recipe} was made from another GGUF than {gguf}")
    ap_dir = ap / "pagedweight"
    manifest = json.loads((ap_dir / "manifest.json").read_text())
    options = {"table_kind": "bcq", "bits_min": 2, "bits_max": 8, "group_size": 32, "seed": 0, "calibration": None}
    if any(manifest[k] != v for k, v in options.items()):
        raise SystemExit(f"{ap_dir}/manifest.json was not converted with {options}")
    expected["ap_manifest"] = {"sha256": sha256_file(ap_dir / "manifest.json")}
    expected["ap_files"] = {name: entry["sha256"] for name, entry in manifest["files"].items()}

    split_file(gguf, parse_sizes(args.sizes), out / "gguf", "part-")
    (out / "recipe").mkdir(parents=True)
    shutil.copyfile(recipe / "recipe.json", out / "recipe" / "recipe.json")
    split_file(recipe / PAYLOAD_NAME, parse_sizes(args.payload_sizes), out / "recipe", "payload-part-")
    if args.calibration is not None:
        (out / "calibration").mkdir()
        copy = out / "calibration" / args.calibration.name
        shutil.copyfile(args.calibration, copy)  # hash the copy: the original may be rewritten meanwhile
        _check_calibration_identity(copy, manifest)
        expected["calibration"] = {"name": copy.name, "sha256": sha256_file(copy)}
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    print(json.dumps({"carry": str(out), "files": sizes, "total_bytes": sum(sizes.values())}, indent=1))
    return 0


def _check_calibration_identity(path: Path, manifest: dict) -> None:
    identity = json.loads(path.read_text()).get("ap", {})
    wanted = {"table_kind": manifest["table_kind"], "bits_min": manifest["bits_min"], "bits_max": manifest["bits_max"],
              "config_sha256": manifest["model"]["config_sha256"]}
    if identity != wanted:
        raise SystemExit(f"calibration file {path} is for AP {identity}, the checkpoint is {wanted}")


# ------------------------------------------------------------------------------------------------ build
def _check(label: str, path: Path, want: str, timings: dict) -> None:
    started = time.perf_counter()
    got = sha256_file(path)
    timings[f"sha256_{label}"] = round(time.perf_counter() - started, 1)
    if got != want:
        raise SystemExit(f"MISMATCH {label}: {path} has sha256 {got}, expected {want}")
    print(f"ok {label}: {path.name} sha256 {got}", flush=True)


def build(args: argparse.Namespace) -> int:
    carry, out = args.carry, args.out
    expected = json.loads((carry / "expected.json").read_text())
    workers = args.workers or os.cpu_count() or 1
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("moe", "ap"):
        if (out / stale).exists():
            shutil.rmtree(out / stale)
    timings: dict[str, float] = {}
    started = time.perf_counter()

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        timings[name] = round(now - since, 1)
        return now

    t = time.perf_counter()
    pieces = sorted((carry / "gguf").glob("part-*"))
    if not pieces:
        raise SystemExit(f"no {carry}/gguf/part-* pieces")
    gguf = out / expected["gguf"]["name"]
    join_pieces(pieces, gguf)
    recipe = out / "recipe"
    recipe.mkdir(exist_ok=True)
    shutil.copyfile(carry / "recipe" / "recipe.json", recipe / "recipe.json")
    join_pieces(sorted((carry / "recipe").glob("payload-part-*")), recipe / PAYLOAD_NAME)
    _check("gguf", gguf, expected["gguf"]["sha256"], timings)
    t = lap("a_join_and_check_gguf", t)

    pagedweight("moefy", "--recipe", str(recipe), "--gguf", str(gguf), "--out", str(out / "moe"))
    _check("moe_weights", out / "moe" / "model.safetensors", expected["moe_weights"]["sha256"], timings)
    t = lap("b_moefy_recipe", t)

    pagedweight("convert", "--model", str(out / "moe"), "--out", str(out / "ap"), *expected["convert_options"],
                "--workers", str(workers))
    t_convert = lap("c_convert", t)
    ap_dir = out / "ap" / "pagedweight"
    for name, digest in expected["ap_files"].items():
        _check(f"ap_shard {name}", ap_dir / name, digest, timings)
    _check("ap_manifest", ap_dir / "manifest.json", expected["ap_manifest"]["sha256"], timings)
    if "calibration" in expected:
        copy = carry / "calibration" / expected["calibration"]["name"]
        _check("calibration", copy, expected["calibration"]["sha256"], timings)
        _check_calibration_identity(copy, json.loads((ap_dir / "manifest.json").read_text()))
        shutil.copyfile(copy, ap_dir / copy.name)
        print(f"calibration {copy.name} installed next to the matching manifest", flush=True)
    lap("c_checks", t_convert)
    timings["total"] = round(time.perf_counter() - started, 1)
    print(json.dumps({"out": str(out), "workers": workers, "cpu_count": os.cpu_count(), "timings_s": timings,
                      "moe": str(out / "moe"), "ap": str(out / "ap")}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="write the carry folder here")
    p.add_argument("--sizes", required=True, help="GGUF piece sizes, e.g. 8M,6M,24M,rest")
    p.add_argument("--payload-sizes", default="rest", help="recipe payload piece sizes (default: one piece)")
    p.add_argument("--out", type=Path, default=Path(".carry/smollm2"))
    p.add_argument("--gguf", type=Path, default=HOME_CACHE / GGUF_NAME)
    p.add_argument("--model", type=Path, default=HOME_CACHE / "quality" / "moe-final")
    p.add_argument("--ap", type=Path, default=HOME_CACHE / "quality" / "ap-bcq")
    p.add_argument("--recipe", type=Path, default=HOME_CACHE / "recipes" / "smollm2-moe-final",
                   help="recipe directory (written with `pagedweight moefy-recipe` when it has no recipe.json)")
    p.add_argument("--calibration", type=Path,
                   default=HOME_CACHE / "quality" / "ap-bcq" / "pagedweight" / "calibration-wiki-2048.json",
                   help="calibration file to carry")
    p.set_defaults(func=prepare)
    b = sub.add_parser("build", help="rebuild and check on the device")
    b.add_argument("--carry", type=Path, default=Path(".carry/smollm2"))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--workers", type=int, default=0, help="convert processes (default: all cores)")
    b.set_defaults(func=build)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
