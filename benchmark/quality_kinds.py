"""Do w13 and w2 sensitivities sit on one scale (and early and late layers)? Predicted vs measured damage.

    python benchmark/quality_kinds.py --calibration CALIB.json [--calibration OLD.json ...] \
        [--cache-dir ~/.cache/pagedweight/quality] [--windows 4] [--out docs/results/quality_kinds.json]

For each projection kind (w13 = gate||up, w2 = down) and b in --bits, every block of that kind is lowered
from 8 to b bits while the other kind stays at 8, and KL(bf16 || model) is measured on calibration-split
text after the calibration's tokens (not the evaluation split). The planner's predicted damage of the same
change is sum over blocks of mu_bucket * (s^b - s^8) from each calibration file (eta ~ 1 is left out; the
file's heads bound it). If the damage model puts both kinds on one scale, the ratio
(predicted damage per freed byte of w13) / (that of w2) is close to the measured (KL per byte) ratio.
The same comparison is made between the first and the second half of the layers (both kinds lowered to
--layer-bits), which the projection-kind fix does not address. Older calibration files (format version 1)
are read for their sensitivity tables only, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality.swap import ExpertBank, runtime_blocks  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def predicted_damage(calib_path: Path, keys, bits: int) -> float:
    """sum over `keys` of mu_bucket(l, e) * (s^bits - s^8), read from the raw calibration JSON."""
    from pagedweight.planner.routing_stats import BlockBuckets, BucketConfig

    raw = json.loads(Path(calib_path).read_text())
    s = {(e["layer"], e["expert"], e["proj"]): {int(b): v for b, v in e["s"].items()} for e in raw["sensitivity"]}
    buckets = BucketConfig.from_json(raw["buckets"])
    mass = np.asarray(raw["routing"]["mass"]) * raw["num_experts"]
    labels = BlockBuckets.from_stats(buckets, mass).labels
    top = max(next(iter(s.values())))
    total = 0.0
    for key in keys:
        tab = s[(key.layer, key.expert, key.proj)]
        total += buckets.mu[labels[(key.layer, key.expert)]] * (tab[bits] - tab[top])
    return total


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedweight.format.checkpoint import APCheckpoint
    from pagedweight.moefy import text as texts
    from pagedweight.moefy.perplexity import evaluate, reference_logits, token_windows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache-dir", type=Path,
                   default=Path(os.environ.get("PAGEDWEIGHT_CACHE", Path.home() / ".cache" / "pagedweight")) / "quality")
    p.add_argument("--calibration", type=Path, action="append", required=True,
                   help="calibration file(s) whose predictions are compared (repeat the flag)")
    p.add_argument("--bits", default="4,3,2", help="bitwidths of the projection-kind comparison")
    p.add_argument("--layer-bits", type=int, default=3, help="bitwidth of the layer-halves comparison (0: skip)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--skip-tokens", type=int, default=2048, help="calibration-split tokens used by calibrate")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "quality_kinds.json")
    p.add_argument("--reuse-measured", type=Path, default=None,
                   help="an earlier output of this script on the same text: its measured KL/ppl are taken "
                        "instead of measuring the same group again (predictions are always recomputed)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = args.cache_dir.expanduser()
    model_dir, ap_dir = cache / "moe-final", cache / "ap-bcq"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ckpt = APCheckpoint.open(ap_dir)
    blocks = runtime_blocks(ckpt)
    bank = ExpertBank(model, {"bcq": ckpt})
    skip = -(-args.skip_tokens // args.seq_len)
    ids = token_windows(tok, texts.calibration_text("wiki"), args.seq_len, skip + args.windows)[skip:]
    ref = reference_logits(model, ids, progress=False)
    top = max(spec.bits_max for _, spec in blocks)
    num_layers = 1 + max(k.layer for k, _ in blocks)
    groups = [(pj, bits, lambda k, pj=pj: k.proj == pj) for bits in (int(b) for b in args.bits.split(",")) for pj in ("w13", "w2")]
    if args.layer_bits:
        half = num_layers // 2
        groups += [(f"layers 0-{half - 1}", args.layer_bits, lambda k: k.layer < half),
                   (f"layers {half}-{num_layers - 1}", args.layer_bits, lambda k: k.layer >= half)]
    text = f"wiki calibration split, windows {skip}..{skip + args.windows - 1} of {args.seq_len} tokens"
    earlier = {}
    if args.reuse_measured is not None:
        old = json.loads(args.reuse_measured.read_text())
        if old["text"] == text:
            earlier = {(r["group"], r["bits"]): r for r in old["rows"]}
    rows = []
    for name, bits, member in groups:
        keys = [k for k, _ in blocks if member(k)]
        freed = sum(spec.bytes_at(top) - spec.bytes_at(bits) for k, spec in blocks if member(k))
        started = time.perf_counter()
        r = earlier.get((name, bits))
        if r is None:
            bank.apply({k: bits for k in keys})
            r = evaluate(model, ids, ref, progress=False)
        row = {"group": name, "bits": bits, "kl": r["kl"], "ppl": r["ppl"], "freed_bytes": freed,
               "predicted_damage": {str(c): predicted_damage(c, keys, bits) for c in args.calibration}}
        rows.append(row)
        print(json.dumps(row), f"({time.perf_counter() - started:.0f} s)", flush=True)
    bank.restore()
    ratios = []
    pairs = [(b, "w13", "w2") for b in sorted({r["bits"] for r in rows if r["group"] == "w13"}, reverse=True)]
    pairs += [(args.layer_bits, groups[-2][0], groups[-1][0])] if args.layer_bits else []
    for bits, ga, gb in pairs:
        a, b = (next(r for r in rows if r["group"] == g and r["bits"] == bits) for g in (ga, gb))
        ratio = {"bits": bits, "pair": f"{ga} / {gb}",
                 "measured_kl_per_byte_ratio": (a["kl"] / a["freed_bytes"]) / (b["kl"] / b["freed_bytes"])}
        for c in args.calibration:
            ratio[f"predicted_per_byte_ratio [{Path(c).name}]"] = (
                (a["predicted_damage"][str(c)] / a["freed_bytes"]) / (b["predicted_damage"][str(c)] / b["freed_bytes"]))
        ratios.append(ratio)
        print(json.dumps(ratio))
    out = {"command": "python benchmark/quality_kinds.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "text": text,
           "rows": rows, "ratios": ratios}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
