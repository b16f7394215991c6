"""Build or reuse the experiment's artifacts in a cache directory, each by its own `pagedweight` command.

    cache/moe/                    pagedweight moefy --out cache/moe
    cache/text/{kind}_calibration.txt  pagedweight.moefy.text.calibration_text(kind)
    cache/ap-{kind}/              pagedweight convert --table-kind {kind} --group-size G --calib-text ...
    cache/ap-bcq/.../calibration-{text}.json   pagedweight calibrate --text cache/text/{text}_calibration.txt

An artifact is reused when its directory (or file) is complete: a model with config.json, an AP checkpoint
with its manifest (written last by the converter), a calibration file (written atomically) that this build
can read (a file of an older calibration format version is made again). The exact
command of every artifact is recorded, whether it ran now or earlier.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ArtifactLog:
    commands: list[dict] = field(default_factory=list)

    def run(self, argv: list[str], output: Path, reuse: bool) -> None:
        """Run `python -m pagedweight ARGV` unless `reuse`; record the command either way."""
        self.start(argv, output, reuse).wait()

    def start(self, argv: list[str], output: Path, reuse: bool) -> "Job":
        """Like run() but in the background: returns a Job to wait() on (artifacts that do not depend on
        each other are built concurrently)."""
        cmd = [sys.executable, "-m", "pagedweight", *argv]
        shown = "pagedweight " + " ".join(shlex.quote(a) for a in argv)
        entry = {"command": shown, "output": str(output), "reused": reuse}
        self.commands.append(entry)
        if reuse:
            print(f"[quality] reusing {output} ({shown})", flush=True)
            return Job(None, entry)
        print(f"[quality] running: {shown}", flush=True)
        return Job(subprocess.Popen(cmd), entry)


class Job:
    def __init__(self, proc: subprocess.Popen | None, entry: dict) -> None:
        self.proc, self.entry, self._start = proc, entry, time.perf_counter()

    def wait(self) -> None:
        if self.proc is None:
            return
        rc = self.proc.wait()
        self.entry.setdefault("seconds", round(time.perf_counter() - self._start, 1))
        if rc != 0:
            raise SystemExit(f"[quality] failed ({rc}): {self.entry['command']}")


def text_file(cache: Path, kind: str, split: str = "calibration") -> Path:
    from pagedweight.moefy import text

    path = cache / "text" / f"{kind}_{split}.txt"
    body = text.calibration_text(kind) if split == "calibration" else text.evaluation_text(kind)
    if not path.is_file() or path.read_text(encoding="utf-8") != body:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body, encoding="utf-8")
    return path


def ensure_model(cache: Path, log: ArtifactLog, model_dir: Path | None = None, threads: int = 2) -> Path:
    if model_dir is not None:  # given by the user: not rebuilt
        if not (Path(model_dir) / "config.json").is_file():
            raise SystemExit(f"--model-dir {model_dir}: no config.json")
        entry = {"command": f"(given) --model-dir {model_dir}", "output": str(model_dir), "reused": True}
        meta = Path(model_dir) / "moefy.json"
        if meta.is_file():  # a `pagedweight moefy` build: record how it was made
            record = json.loads(meta.read_text())
            entry["moefy_build_config"] = record.get("build_config")
            entry["moefy_source"] = record.get("source")
        log.commands.append(entry)
        return Path(model_dir)
    out = cache / "moe"
    done = (out / "moefy.json").is_file()  # written last, after config.json and the weights
    log.run(["moefy", "--out", str(out), "--threads", str(threads), "--quiet"], out, reuse=done)
    return out


def expert_width(model_dir: Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg.get("intermediate_size") or cfg.get("moe_intermediate_size"))


def group_size_for(model_dir: Path) -> int:
    """128 unless the expert width (the down projection's K) is not a multiple of it (192 -> 64)."""
    width = expert_width(model_dir)
    for g in (128, 64, 32, 16, 8):
        if width % g == 0:
            return g
    raise SystemExit(f"expert width {width} has no power-of-two group size >= 8")


def start_ap(cache: Path, log: ArtifactLog, model_dir: Path, kind: str, calib_text: Path,
             calib_tokens: int, seed: int, bcq_init: str = "greedy") -> tuple[Path, Job]:
    out = cache / f"ap-{kind}"
    manifest = out / "pagedweight" / "manifest.json"
    init = bcq_init if kind == "bcq" else "greedy"
    # a finished conversion is reused only if it was made with the same sign-plane init and holds the weight
    # errors the uncalibrated policy reads (converters before them did not write the file)
    done = (manifest.is_file() and json.loads(manifest.read_text()).get("bcq_init", "greedy") == init
            and (out / "pagedweight" / "weight_errors.json").is_file())
    argv = ["convert", "--model", str(model_dir), "--out", str(out), "--table-kind", kind, "--bits-min", "2",
            "--bits-max", "8", "--group-size", str(group_size_for(model_dir)),
            *(["--bcq-init", init] if init != "greedy" else []),
            *(["--calib-text", str(calib_text), "--calib-tokens", str(calib_tokens)] if calib_tokens > 0 else []),
            "--seed", str(seed), *(["--force"] if out.exists() and not done else [])]
    return out, log.start(argv, out, reuse=done)


def start_calibration(log: ArtifactLog, model_dir: Path, ap_dir: Path, text: Path, text_kind: str,
                      tokens: int) -> tuple[Path, Job]:
    out = ap_dir / "pagedweight" / f"calibration-{text_kind}-{tokens}.json"
    argv = ["calibrate", "--model", str(model_dir), "--ap", str(ap_dir), "--text", str(text),
            "--tokens", str(tokens), "--out", str(out)]
    return out, log.start(argv, out, reuse=calibration_current(out))


def calibration_current(path: Path) -> bool:
    """A calibration file is reused only if this build reads it (an older format version is re-made)."""
    from pagedweight.planner.calibration import CalibrationData, CalibrationError

    if not path.is_file():
        return False
    try:
        CalibrationData.load(path)
    except CalibrationError as exc:
        print(f"[quality] not reusing {path}: {exc}", flush=True)
        return False
    return True


def ensure_all(cache: Path, log: ArtifactLog, model_dir: Path, calib_text: Path, calib_kind: str,
               convert_tokens: int, calib_tokens: int, seed: int,
               bcq_init: str = "greedy", main_kind: str = "bcq",
               compare_kinds: tuple[str, ...] = ("bcq", "kmeans")) -> tuple[dict[str, Path], Path]:
    """The conversions (the planned kind `main_kind`, `compare_kinds` for comparison) at once; calibration
    starts as soon as the main kind's checkpoint exists."""
    kinds = [main_kind] + [k for k in compare_kinds if k != main_kind]
    started = {k: start_ap(cache, log, model_dir, k, calib_text, convert_tokens, seed, bcq_init) for k in kinds}
    started[main_kind][1].wait()
    calib, calib_job = start_calibration(log, model_dir, started[main_kind][0], calib_text, calib_kind, calib_tokens)
    for _, job in started.values():
        job.wait()
    calib_job.wait()
    return {k: out for k, (out, _) in started.items()}, calib
