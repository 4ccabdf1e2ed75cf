"""`odmoe-profile`: profile a model's routers over calibration text, for miss.policy=buddy.

    odmoe-profile /models/mixtral --text notes.txt --text more.py   # -> MODEL/odmoe-profile/profile.npz
    odmoe-profile trained --tokens 65536 --out /tmp/p.npz --heatmap-layer 2

Runs the whole model (experts included) in this process over windows of the calibration text and
writes, per MoE layer, activation counts, binary and probability-weighted co-activation matrices,
the TAE percentiles and the buddy lists (`odmoe.tools.profiling`), plus a JSON summary and the
co-activation heatmap of one layer (PNG, needs matplotlib: the `bench` extra). Without --text it
reads standard-library sources (the same files the trained benchmark model learnt from, so its
held-out prompts stay unseen). Exit codes: 0 written, 2 bad arguments or model.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from odmoe.lossy.substitution import profile_path
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.tools.profiling import draw_heatmap, profile_model, save_profile


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="odmoe-profile", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="checkpoint directory, or trained / demo / tiny")
    parser.add_argument("--text", action="append", default=None, help="calibration text file (repeat)")
    parser.add_argument("--out", default="", help="output .npz (default MODEL/odmoe-profile/profile.npz)")
    parser.add_argument("--tokens", type=int, default=32768, help="calibration tokens to run")
    parser.add_argument("--window", type=int, default=256, help="tokens per forward pass")
    parser.add_argument("--alpha", type=float, default=0.9, help="CFT of the buddy lists in the summary")
    parser.add_argument("--k-max", type=int, default=4, help="cap of the buddy lists in the summary")
    parser.add_argument("--heatmap-layer", type=int, default=None, help="layer drawn (default: first)")
    return parser.parse_args(argv)


def calibration_windows(tokenizer, files: list[str], tokens: int, window: int) -> list[list[int]]:
    """Consecutive `window`-token windows of the files' text, `tokens` in all (fewer if short)."""
    ids: list[int] = []
    for name in files:
        ids += tokenizer(Path(name).read_text(errors="replace"))["input_ids"]
        if len(ids) >= tokens:
            break
    ids = ids[:tokens]
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)] or [ids]


def _progress(start: float):
    def show(done: int, total: int) -> None:
        rate = done / max(time.perf_counter() - start, 1e-9)
        print(f"\rprofiling: window {done}/{total} ({rate:.1f}/s)", end="", file=sys.stderr, flush=True)
        if done == total:
            print(file=sys.stderr)

    return show


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from odmoe.tools.model_factory import corpus_files
    from odmoe.tools.model_names import resolve_model
    from odmoe.tools.training import TRAINED_SETTINGS

    try:
        path = resolve_model(args.model)
        checkpoint = open_checkpoint(path)
    except (ValueError, OSError) as exc:
        print(f"odmoe-profile: {exc}", file=sys.stderr)
        return 2
    files = args.text or corpus_files(TRAINED_SETTINGS["mixtral"].corpus_bytes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = load_tokenizer(path)
    windows = calibration_windows(tokenizer, files, args.tokens, args.window)
    profile = profile_model(model, windows, checkpoint.num_experts, _progress(time.perf_counter()))
    out = save_profile(profile, profile_path(path, args.out), args.alpha, args.k_max)
    print(
        f"wrote {out} and {out.with_suffix('.json')} ({profile.tokens} tokens, {len(profile.layers)} layers)"
    )
    layer = args.heatmap_layer if args.heatmap_layer is not None else min(profile.layers)
    try:
        png = draw_heatmap(profile, layer, out.with_name(f"coactivation-layer{layer}.png"))
        print(f"drew {png}")
    except ImportError:
        print("no heatmap: matplotlib is missing (pip install 'odmoe[bench]')", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
